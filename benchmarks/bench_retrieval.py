"""Exact vs HNSW block retrieval: where HNSW gets faster, and what recall it pays for it.

For each number of candidate blocks m (--blocks) it times model/retrieval.py's two retrievers on
the same block summaries (b=1, per kv head):
    decode   one query per kv head against m blocks, the cost a decoding token pays (median over
             --decode_queries queries);
    prefill  a batch of --prefill_queries queries per kv head (median over --prefill_repeats);
    build    (HNSW) inserting the m summaries into the graphs;
and the recall@top_n of HNSW against exact over the prefill batch, for the config's HNSW
settings and for each efSearch of --ef_sweep. It prints the crossover (the smallest m from which
HNSW at the default efSearch decodes faster than exact) and the ann_auto_threshold that follows.

Sharded (--shards N ...): the m blocks split into N contiguous shards, one set of HNSW graphs per
shard, each searched for its shard's top-n and merged as context-parallel ranks merge them
(model/context_parallel.py local_selection and global_top_n); recall@top_n of the merged answer
against exact over all m blocks, and the build and search time summed over the shards (one
machine doing every shard's work; with one machine per shard each takes about 1/N of it).

Selection by the best key (--summary keys, or a model whose ann_block_summary is "keys"): the
graphs hold the keys themselves (model/hnsw.KeyHnswRetriever: each query head's --keys_per_head
best keys found, their blocks re-scored exactly), exact scores every candidate key, and build is
inserting m*B keys per kv head. Synthetic keys are then per token (synthetic_blocks over m*B
vectors) and each query is r = --query_heads heads of one GQA group that seek one topic, each with
its own noise.

Keys. With --model PATH they are the model's own: the text (--text) runs through the model in
chunks with a KV cache, and a wrapper around layer --layer's attention core records its keys and
its GQA-summed queries; summaries are block means of B keys, and the queries at m blocks are the
ones that follow the first m blocks in the text. Without a model they are synthetic but shaped
like real keys (see `synthetic_blocks`), not iid Gaussian, whose top-n is unrealistically easy.

    python benchmarks/bench_retrieval.py --json docs/bench/retrieval_synthetic.json
    python benchmarks/bench_retrieval.py --model out/pretrain/model --blocks 256 1024 4096 16384 \\
        --model_tokens 270000 --json docs/bench/retrieval_model.json
    python benchmarks/bench_retrieval.py --blocks 65536 --shards 1 2 4 --ef_sweep 256 \
        --json docs/bench/retrieval_sharded_1m.json    # 65536 blocks of 16: a 1M-token context
    python benchmarks/bench_retrieval.py --summary keys --head_dim 16 --blocks 256 1024 4096 16384 65536 \
        --hnsw_m 16 --ef_construction 64 --ef_search 64 --ef_sweep 32 128 --json docs/bench/retrieval_keys.json
"""

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    add_allocator_flag,
    apply_allocator,
    format_table,
    machine_info,
    median_ms,
    model_keys,
    plot_panels,
    png_path_for,
    set_threads,
    time_calls,
    write_json,
)
from common.cli import UsageError
from model.config import BLOCK_SUMMARIES, MiniMindConfig
from model.context_parallel import global_top_n, local_selection
from model.hnsw import HnswRetriever, KeyHnswRetriever
from model.retrieval import block_summaries, exact_select


def parse_args(argv=None):
    defaults = MiniMindConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024, 4096, 16384, 65536])
    p.add_argument("--top_n", type=int, default=defaults.ann_top_n)
    p.add_argument("--hnsw_m", type=int, default=defaults.hnsw_m)
    p.add_argument("--ef_construction", type=int, default=defaults.hnsw_ef_construction)
    p.add_argument("--ef_search", type=int, default=defaults.hnsw_ef_search, help="the default being evaluated")
    p.add_argument("--ef_sweep", type=int, nargs="*", default=[16, 32, 128, 256], help="other efSearch values")
    p.add_argument("--decode_queries", type=int, default=50)
    p.add_argument("--prefill_queries", type=int, default=256)
    p.add_argument("--prefill_repeats", type=int, default=3)
    p.add_argument("--min_recall", type=float, default=0.9, help="recall the recommended threshold must keep")
    p.add_argument("--summary", choices=BLOCK_SUMMARIES, default=None,
                   help="keys: selection by the best key; default: the model's, or block vectors for synthetic keys")
    p.add_argument("--keys_per_head", type=int, default=defaults.hnsw_keys_per_head, help="--summary keys: HNSW keys per query head")
    p.add_argument("--block_size", type=int, default=defaults.ann_block_size, help="synthetic keys, --summary keys")
    p.add_argument("--query_heads", type=int, default=4, help="synthetic keys, --summary keys: heads per GQA group")
    p.add_argument("--kv_heads", type=int, default=2, help="synthetic keys")
    p.add_argument("--head_dim", type=int, default=64, help="synthetic keys")
    p.add_argument("--model", default=None, help="a model folder, out dir or checkpoint .pt: use its keys and queries")
    p.add_argument("--text", default="/work/shared/data/tinyshakespeare.txt")
    p.add_argument("--model_tokens", type=int, default=65536, help="tokens of --text run through the model")
    p.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    p.add_argument("--model_chunk", type=int, default=2048, help="tokens per prefill call")
    p.add_argument("--model_retrieval", default=None,
                   help="the retrieval the model runs with while its keys are recorded (default: its own)")
    p.add_argument("--shards", type=int, nargs="*", default=[], help="also HNSW per shard, merged, for these shard counts")
    p.add_argument("--shuffled_insertion", action="store_true",
                   help="insert the blocks in a random order instead of block order (recall only: not causal)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_allocator_flag(p)
    p.add_argument("--json", default="docs/bench/retrieval.json")
    p.add_argument("--png", default=None, help="default: the --json path with .png")
    return p.parse_args(argv)


def synthetic_blocks(num_blocks, num_queries, kv_heads, head_dim, seed, rank=16, topics=64, mean_run=8):
    """Block summaries (1, g, m, d) and queries (1, g, q, d) with the structure of real keys.

    Keys of a trained model share a large mean direction that drifts slowly along the text, and
    the rest lives mostly in a low-dimensional subspace where the topic of the passage sits: the
    text stays on one of a few dozen recurring topics for runs of blocks. Summaries are that:
    drifting mean + the topic's point in a rank-`rank` subspace + small isotropic noise. A query
    looks for one topic: its point in the same subspace plus noise.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    basis = randn(kv_heads, rank, head_dim) / rank**0.5
    topic_points = 2.0 * randn(kv_heads, topics, rank)
    # Geometric run lengths (mean `mean_run` blocks) by inversion, so the generator fixes them too.
    run_lengths = (torch.rand(num_blocks, generator=generator).log() / math.log(1 - 1 / mean_run)).long() + 1
    run_topics = torch.randint(topics, (num_blocks,), generator=generator)
    block_topics = run_topics.repeat_interleave(run_lengths)[:num_blocks]
    drifting_mean = 1.5 * randn(kv_heads, 1, head_dim) + (0.02 * randn(kv_heads, num_blocks, head_dim)).cumsum(1)
    summaries = drifting_mean + topic_points[:, block_topics] @ basis + 0.3 * randn(kv_heads, num_blocks, head_dim)
    query_topics = torch.randint(topics, (num_queries,), generator=generator)
    queries = topic_points[:, query_topics] @ basis + 0.5 * randn(kv_heads, num_queries, head_dim)
    return summaries[None], queries[None]


def hnsw_settings(args, ef_search):
    return (args.hnsw_m, args.ef_construction, ef_search)


def hnsw_retriever(args, summaries):
    """The HNSW retriever of the summaries' kind: over keys for "keys" summaries (b, g, m, B, d)."""
    if summaries.dim() == 5:
        return KeyHnswRetriever(summaries.shape[3], args.keys_per_head, *hnsw_settings(args, args.ef_search))
    return HnswRetriever(*hnsw_settings(args, args.ef_search))


def recall(found_ids, found_valid, exact_ids, exact_valid):
    """Mean over queries of the fraction of the exact top-n that was found."""
    found = torch.where(found_valid, found_ids, -1)
    hits = (found[..., :, None] == exact_ids[..., None, :]) & exact_valid[..., None, :] & (found[..., :, None] >= 0)
    return float(hits.any(dim=-2).sum() / exact_valid.sum())


def measure(args, summaries, decode_queries, prefill_queries):
    """Rows for one block count: exact, then HNSW at the default efSearch and each --ef_sweep value."""
    m = summaries.shape[2]
    decode_limits = torch.tensor([[m]])
    prefill_limits = torch.full((1, prefill_queries.shape[2]), m)

    def time_decode(select):
        index = [0]

        def one_query():
            i = index[0] % decode_queries.shape[2]
            select(decode_queries[:, :, i : i + 1], summaries, decode_limits, args.top_n)
            index[0] += 1

        return median_ms(time_calls(one_query, 3, args.decode_queries, "cpu"))

    def time_prefill(select):
        return median_ms(time_calls(lambda: select(prefill_queries, summaries, prefill_limits, args.top_n), 1,
                                    args.prefill_repeats, "cpu"))

    exact_ids, exact_valid = exact_select(prefill_queries, summaries, prefill_limits, args.top_n)
    rows = [{"impl": "exact", "blocks": m, "ef_search": None, "decode_ms": time_decode(exact_select),
             "prefill_ms": time_prefill(exact_select), "build_ms": None, "recall": 1.0}]

    retriever = hnsw_retriever(args, summaries)
    # Shuffled: the graphs get the blocks in a random order (not causal; what block order costs).
    order = torch.randperm(m, generator=torch.Generator().manual_seed(args.seed)) if args.shuffled_insertion else None
    started = time.perf_counter()
    retriever.add_candidates(summaries if order is None else summaries[:, :, order], decode_limits)
    build_ms = 1000 * (time.perf_counter() - started)
    for ef_search in [args.ef_search] + [ef for ef in args.ef_sweep if ef != args.ef_search]:
        # efSearch only steers the search, so one built graph serves every value of the sweep.
        for graph in retriever.graphs[0]:
            graph.index.hnsw.efSearch = ef_search
        found_ids, found_valid = retriever.select(prefill_queries, summaries, prefill_limits, args.top_n)
        if order is not None:
            found_ids = order[found_ids]
        rows.append({
            "impl": "hnsw", "blocks": m, "ef_search": ef_search, "decode_ms": time_decode(retriever.select),
            "prefill_ms": time_prefill(retriever.select), "build_ms": build_ms,
            "recall": recall(found_ids, found_valid, exact_ids, exact_valid),
        })
    return rows


def sharded_rows(args, summaries, queries, shards, ef_values):
    """Per-shard HNSW merged over `shards` contiguous shards of the blocks: a row per efSearch."""
    m = summaries.shape[2]
    limits = torch.full((1, queries.shape[2]), m)
    exact_ids, exact_valid = exact_select(queries, summaries, limits, args.top_n)
    bounds = [m * rank // shards for rank in range(shards + 1)]
    parts = [(lo, summaries[:, :, lo:hi].contiguous(), limits.clamp(max=hi - lo)) for lo, hi in zip(bounds, bounds[1:])]
    retrievers = [HnswRetriever(*hnsw_settings(args, args.ef_search)) for _ in parts]
    started = time.perf_counter()
    for retriever, (_, part, part_limits) in zip(retrievers, parts):
        retriever.add_candidates(part, part_limits)
    build_ms = 1000 * (time.perf_counter() - started)
    rows = []
    for ef_search in ef_values:
        for retriever in retrievers:
            for graph in retriever.graphs[0]:
                graph.index.hnsw.efSearch = ef_search

        def merged():
            local = [local_selection(retriever, queries, part, part_limits, args.top_n, lo)
                     for retriever, (lo, part, part_limits) in zip(retrievers, parts)]
            return global_top_n(torch.stack([scores for scores, _ in local]), torch.stack([ids for _, ids in local]), args.top_n)

        ids, valid = merged()
        rows.append({"impl": "hnsw_sharded", "shards": shards, "blocks": m, "ef_search": ef_search, "build_ms": build_ms,
                     "prefill_ms": median_ms(time_calls(merged, 1, args.prefill_repeats, "cpu")),
                     "recall": recall(ids, valid, exact_ids, exact_valid)})
    return rows


def crossover(rows, blocks, key, ef_search):
    """Smallest measured block count from which HNSW (at ef_search) beats exact at every larger one."""
    winning = []
    for m in blocks:
        exact = next(r[key] for r in rows if r["blocks"] == m and r["impl"] == "exact")
        hnsw = next(r[key] for r in rows if r["blocks"] == m and r["ef_search"] == ef_search)
        winning.append(hnsw < exact)
    for i, m in enumerate(blocks):
        if all(winning[i:]):
            return m
    return None


def recommend_threshold(rows, decode_crossover, ef_search, min_recall):
    """The auto threshold is in candidate blocks and matters most for decoding latency: the decode
    crossover, provided HNSW keeps --min_recall there. Returns (threshold or None, why)."""
    if decode_crossover is None:
        return None, "HNSW never decodes faster than exact here: keep exact (threshold above the largest count)"
    default_rows = [r for r in rows if r["ef_search"] == ef_search and r["blocks"] >= decode_crossover]
    at_crossover = default_rows[0]["recall"]
    if at_crossover < min_recall:
        return None, (f"HNSW decodes faster from {decode_crossover} blocks, but its recall there is "
                      f"{at_crossover:.3f} < --min_recall {min_recall}: raise efSearch (see the sweep) or keep exact")
    why = f"HNSW decodes faster from {decode_crossover} blocks, recall {at_crossover:.3f} there"
    worst = min(default_rows, key=lambda r: r["recall"])
    if worst["recall"] < min_recall:
        why += f"; recall falls to {worst['recall']:.3f} at {worst['blocks']} blocks (raise efSearch for such caches)"
    return decode_crossover, why


def main(argv=None):
    args = parse_args(argv)
    apply_allocator(args.allocator)
    set_threads(args.threads)
    blocks = sorted(args.blocks)
    num_queries = args.decode_queries + args.prefill_queries
    if args.model:
        try:
            layer = args.layer
            # The model runs with the benchmark's HNSW settings (they matter with --model_retrieval hnsw).
            named = {"ann_block_summary": args.summary, "ann_retrieval": args.model_retrieval, "hnsw_m": args.hnsw_m,
                     "hnsw_ef_construction": args.ef_construction, "hnsw_ef_search": args.ef_search,
                     "hnsw_keys_per_head": args.keys_per_head}
            overrides = {name: value for name, value in named.items() if value is not None}
            captured, config = model_keys(args.model, args.text, args.model_tokens, [layer], args.model_chunk, overrides)
            keys, group_queries = captured[config.num_hidden_layers // 2 if layer is None else layer]
        except (UsageError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        summary, block_size, window = config.ann_block_summary, config.ann_block_size, config.ann_window
        available = (keys.shape[2] - window - num_queries) // block_size
        if any(m > available for m in blocks):
            print(f"the captured {keys.shape[2]} tokens give at most {available} blocks with {num_queries} queries "
                  f"after them: skipping {[m for m in blocks if m > available]} (raise --model_tokens)")
        blocks = [m for m in blocks if m <= available]
        source = f"model {args.model}"
    elif args.summary == "keys":
        summary, block_size = "keys", args.block_size
        keys, queries = synthetic_blocks(blocks[-1] * block_size, num_queries, args.kv_heads, args.head_dim, args.seed)
        # The heads of a group look for one topic, each with its own noise.
        noise = torch.randn(*queries.shape[:3], args.query_heads, args.head_dim, generator=torch.Generator().manual_seed(args.seed))
        queries = queries[:, :, :, None] + 0.5 * noise
        source = "synthetic per-token keys (drifting mean + recurring low-rank topics + noise)"
    else:
        summary = None
        all_summaries, queries = synthetic_blocks(blocks[-1], num_queries, args.kv_heads, args.head_dim, args.seed)
        source = "synthetic (drifting mean + recurring low-rank topics + noise)"
    if summary == "keys" and args.shards:
        print("error: --shards: context parallelism does not serve 'keys' selection", file=sys.stderr)
        return 2

    rows, sharded = [], []
    every_ef = [args.ef_search] + [ef for ef in args.ef_sweep if ef != args.ef_search]
    for m in blocks:
        if args.model:
            # The queries right after the first m blocks (and the window) have those m blocks as candidates.
            first_query = m * block_size + window
            summaries = block_summaries(keys, 0, m, block_size, summary)
            queries = group_queries[:, :, first_query : first_query + num_queries]
        elif summary == "keys":
            summaries = block_summaries(keys, 0, m, block_size, summary)
        else:
            summaries = all_summaries[:, :, :m]
        point = measure(args, summaries.contiguous(), queries[:, :, : args.decode_queries],
                        queries[:, :, args.decode_queries :])
        rows += point
        hnsw = point[1]
        print(f"blocks {m:6d}: exact decode {point[0]['decode_ms']:.3f} ms, hnsw {hnsw['decode_ms']:.3f} ms, "
              f"recall {hnsw['recall']:.3f}, build {hnsw['build_ms']:.0f} ms", flush=True)
        for shards in args.shards:
            sharded += sharded_rows(args, summaries.contiguous(), queries[:, :, args.decode_queries :], shards, every_ef)

    decode_crossover = crossover(rows, blocks, "decode_ms", args.ef_search)
    prefill_crossover = crossover(rows, blocks, "prefill_ms", args.ef_search)
    threshold, why = None, "nothing measured"
    if rows:
        threshold, why = recommend_threshold(rows, decode_crossover, args.ef_search, args.min_recall)
    print()
    print(format_table(rows, [
        ("impl", "impl", "{}"), ("blocks", "blocks", "{}"), ("efSearch", "ef_search", "{}"),
        ("decode_ms", "decode_ms", "{:.4f}"), (f"prefill{args.prefill_queries}_ms", "prefill_ms", "{:.3f}"),
        ("build_ms", "build_ms", "{:.0f}"), (f"recall@{args.top_n}", "recall", "{:.3f}"),
    ]))
    print(f"\ncrossover (HNSW efSearch {args.ef_search} faster than exact): decode from {decode_crossover} blocks, "
          f"prefill of {args.prefill_queries} queries from {prefill_crossover} blocks")
    print(f"recommended ann_auto_threshold: {threshold} ({why})")
    if sharded:
        print("\nHNSW per shard, merged (build and search summed over the shards):")
        print(format_table(sharded, [
            ("blocks", "blocks", "{}"), ("shards", "shards", "{}"), ("efSearch", "ef_search", "{}"),
            (f"prefill{args.prefill_queries}_ms", "prefill_ms", "{:.3f}"), ("build_ms", "build_ms", "{:.0f}"),
            (f"recall@{args.top_n}", "recall", "{:.3f}"),
        ]))

    config = {key: value for key, value in vars(args).items() if key not in ("json", "png")}
    config.update(keys=source, summary=summary, machine=machine_info("cpu"))
    write_json(args.json, config, rows, crossover={"decode": decode_crossover, "prefill": prefill_crossover},
               recommended_ann_auto_threshold=threshold, recommendation=why, sharded=sharded)

    def lines(key, hnsw_efs):
        by_impl = {"exact": [(r["blocks"], r[key]) for r in rows if r["impl"] == "exact"]}
        for ef in hnsw_efs:
            by_impl[f"hnsw ef={ef}"] = [(r["blocks"], r[key]) for r in rows if r["ef_search"] == ef]
        return by_impl

    panels = [
        ("decode: one query per kv head", "candidate blocks", "ms", lines("decode_ms", every_ef)),
        (f"prefill: {args.prefill_queries} queries per kv head", "candidate blocks", "ms",
         lines("prefill_ms", every_ef)),
        (f"HNSW recall@{args.top_n} vs exact", "candidate blocks", "recall", lines("recall", every_ef), "linear"),
        ("HNSW build (all blocks, every kv head)", "candidate blocks", "ms", lines("build_ms", [args.ef_search])),
    ]
    over_keys = f", {args.keys_per_head} keys per head" if summary == "keys" else ""
    title = (f"retrieval, top_n={args.top_n}, HNSW M={args.hnsw_m} efC={args.ef_construction}{over_keys}, "
             f"{args.threads} threads; keys: {source}")
    plot_panels(png_path_for(args.json, args.png), title, panels)


if __name__ == "__main__":
    sys.exit(main())
