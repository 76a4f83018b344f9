"""Context parallelism on this machine: one long prompt sharded over 1, 2, 4 gloo ranks (forked processes).

Per world size: prefill time (the slowest rank), each rank's peak RSS above its start, decode
ms/token, and the payload each rank hands to collectives per decoded token (model/context_parallel.py
ShardGroup.bytes_sent). The prompt is passkey-shaped (filler with one key segment repeated at the
end); the model is an untrained tiny ANN model, so this measures cost, not retrieval quality.
Then the cost model (cost_model) extrapolates to 1B tokens over M machines (docs/SCALING.md).

    python benchmarks/bench_context_parallel.py --length 16384 --ranks 1 2 4
    python benchmarks/bench_context_parallel.py --length 1048576 --ranks 1 2 4 --retrieval hnsw \
        --json docs/bench/context_parallel_1m.json    # each rank searches HNSW graphs of its own blocks
    torchrun --nproc_per_node 4 benchmarks/bench_context_parallel.py --length 16384   # one row per rank
"""

import argparse
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import PeakMemory, format_table, machine_info, plot_panels, write_json  # noqa: E402
from model.config import MiniMindConfig  # noqa: E402
from model.context_parallel import ContextParallelLM, join_group, split_by_blocks  # noqa: E402
from model.model import MiniMindForCausalLM  # noqa: E402

MODEL = dict(vocab_size=6400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             attn_impl="ann", ann_window=64, ann_block_size=16, ann_top_n=4, key_shift=1)


def passkey_prompt(length, seed=0):
    """(1, length) ids: random filler with a 16-token key segment early on, repeated as the last tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MODEL["vocab_size"], (1, length), generator=generator)
    key = ids[:, length // 8 : length // 8 + 16].clone()
    ids[:, -16:] = key
    return ids


def rank_main(rank, world, init_method, length, decode_steps, retrieval, results):
    """One rank's measurement, put on `results` (a queue, or a list under torchrun)."""
    torch.set_num_threads(1)
    group = join_group(rank, world, init_method, 3600.0)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**MODEL, ann_retrieval=retrieval)).eval()
    ids = passkey_prompt(length)
    bounds = split_by_blocks(length, world, MODEL["ann_block_size"])
    memory = PeakMemory("cpu")
    with torch.no_grad():
        sharded = ContextParallelLM(model, group, bounds)
        begin = time.perf_counter()
        logits = sharded.prefill(ids[:, bounds[rank] : bounds[rank + 1]], last_only=True)
        prefill_s = time.perf_counter() - begin
        token = ids[:, -1:]
        sent, messages = group.bytes_sent, group.messages
        begin = time.perf_counter()
        for _ in range(decode_steps):
            token = sharded.decode(token)[:, -1:].argmax(-1)
        decode_ms = 1000 * (time.perf_counter() - begin) / decode_steps
    del logits
    (results.put if hasattr(results, "put") else results.append)(dict(rank=rank, prefill_s=prefill_s, peak_rss_mb=memory.peak_mb(), decode_ms=decode_ms,
                     bytes_per_token=(group.bytes_sent - sent) / decode_steps,
                     messages_per_token=(group.messages - messages) / decode_steps))


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(world, length, decode_steps, retrieval, timeout_s):
    """One forked launch of `world` ranks -> one row per rank (raises if a rank fails or overruns)."""
    context = multiprocessing.get_context("fork")
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=rank_main, args=(rank, world, f"tcp://127.0.0.1:{port}", length, decode_steps,
                                                         retrieval, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    rows = [results.get(timeout=timeout_s) for _ in processes]
    for process in processes:
        process.join()
    if any(process.exitcode for process in processes):
        raise RuntimeError(f"a rank of the {world}-rank launch failed: exit codes {[p.exitcode for p in processes]}")
    return [dict(world=world, length=length, retrieval=retrieval, **row) for row in sorted(rows, key=lambda row: row["rank"])]


def cost_model(tokens, machines, config=MODEL, bytes_per_value=2, hnsw_m=32, prefill_tokens_per_s=None):
    """Per layer and per shard, for a context of `tokens` over `machines` shards -> dict.

    KV: 2*g*d values per token; summaries ("bounds"): 2*g*d per block of B; an HNSW graph per
    (kv head): about 2*M int32 links plus its copy of the summary per block. Decode per layer: three
    collectives (selection all_gather of (score, id) float64 pairs, all_reduce max, all_reduce sum of
    (total, weighted values) float32). Prefill: each query tile is broadcast (h*d float32 per token).
    """
    g, h = config["num_key_value_heads"], config["num_attention_heads"]
    d = config["hidden_size"] // h
    block, top_n = config["ann_block_size"], config["ann_top_n"]
    per_shard = tokens / machines
    kv = 2 * g * d * bytes_per_value
    summaries = 2 * g * d * bytes_per_value / block
    graphs = g * (2 * hnsw_m * 4 + 2 * d * 4) / block
    decode_bytes = machines * g * top_n * 2 * 8 + h * 4 + h * (d + 1) * 4
    row = dict(tokens=tokens, machines=machines, kv_bytes_per_token=kv, summary_bytes_per_token=summaries,
               graph_bytes_per_token=graphs, shard_gb_per_layer=per_shard * (kv + summaries + graphs) / 1e9,
               decode_messages_per_token=3, decode_payload_bytes_per_token=decode_bytes,
               prefill_broadcast_gb_per_layer=tokens * h * d * 4 / 1e9)
    if prefill_tokens_per_s:
        row["prefill_s_per_shard"] = per_shard / prefill_tokens_per_s
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--decode_steps", type=int, default=16)
    parser.add_argument("--retrieval", choices=("exact", "hnsw", "auto"), default="exact",
                        help="each rank's selection over its own blocks")
    parser.add_argument("--timeout_s", type=float, default=3600)
    parser.add_argument("--json", default="docs/bench/context_parallel.json")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: this process is one rank; each prints its row
        rows = []
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args.length, args.decode_steps,
                  args.retrieval, rows)
        print(rows[0])
        return
    rows = [row for world in args.ranks for row in measure(world, args.length, args.decode_steps, args.retrieval, args.timeout_s)]
    print(format_table(rows, [("ranks", "world", "{}"), ("rank", "rank", "{}"), ("prefill s", "prefill_s", "{:.2f}"),
                              ("peak RSS MB", "peak_rss_mb", "{:.1f}"), ("decode ms/token", "decode_ms", "{:.1f}"),
                              ("bytes sent/token", "bytes_per_token", "{:.0f}"),
                              ("messages/token", "messages_per_token", "{:.0f}")]))
    single = [row for row in rows if row["world"] == min(args.ranks)]
    tokens_per_s = args.length / max(row["prefill_s"] for row in single) * min(args.ranks)
    plan = [cost_model(10**9, machines, prefill_tokens_per_s=tokens_per_s) for machines in (64, 256, 1024)]
    print(format_table(plan, [("tokens", "tokens", "{:.0e}"), ("machines", "machines", "{}"),
                              ("GB/shard/layer", "shard_gb_per_layer", "{:.2f}"),
                              ("decode B/token/layer", "decode_payload_bytes_per_token", "{:.0f}"),
                              ("prefill s/shard (this model and CPU)", "prefill_s_per_shard", "{:.0f}")]))
    write_json(args.json, dict(model=MODEL, length=args.length, decode_steps=args.decode_steps, retrieval=args.retrieval), rows,
               plan=plan, machine=machine_info("cpu"))
    panels = [(f"{metric} ({args.length} tokens)", "ranks", metric,
               {f"rank {rank}": [(row["world"], row[key]) for row in rows if row["rank"] == rank] for rank in range(max(args.ranks))})
              for metric, key in (("prefill s", "prefill_s"), ("peak RSS MB", "peak_rss_mb"), ("decode ms/token", "decode_ms"))]
    plot_panels(Path(args.json).with_suffix(".png"), f"Context parallelism, gloo on one CPU machine, {args.retrieval} retrieval", panels)


if __name__ == "__main__":
    main()
