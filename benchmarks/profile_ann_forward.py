"""Where one ANN attention forward spends its time, part by part, next to dense attention.

The same random q/k/v and core settings as benchmarks/bench_attention.py (fwd mode: one causal
pass over seq_len tokens, no grad, no cache). Each part's wall time is summed over the forward's
query tiles by wrapping the functions the tiled path calls (model/ann_attention.py):
    queries    AnnAttention.tile_queries: rotation into the window and block frames, selection vectors;
    selection  the retriever's select: every tile's top-n blocks (exact: one matmul per tile and top-k);
    gather     BlockTables.gather minus the selection inside it: the selected blocks' keys and values;
    attend     attend_tile: logits over window and gathered keys, softmax, weighted values;
    rest       the forward's time outside those: slabs, block tables, summaries, the output.
Up to 1024 queries (MASKED_SDPA_MAX_LEN) the forward takes the masked-SDPA path instead: only
selection is timed apart there, everything else is rest.
Dense is timed in the same process, alternating with ANN (median of --repeats); then --repeats
profiled ANN calls, of which the median one's parts are reported. A wrapped call is timed with the
device synchronised around it, so the parts add up to the profiled forward's time.

    python benchmarks/profile_ann_forward.py --lengths 8192 32768 65536 --json docs/bench/ann_forward_parts.json
"""

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    add_attention_row_flags,
    build_core,
    format_table,
    machine_info,
    median_ms,
    random_qkv,
    rope_at,
    set_threads,
    synchronize,
    time_interleaved,
    write_json,
)
from model import ann_attention

PARTS = ("queries", "selection", "gather", "attend", "rest")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--retrieval", choices=("exact", "hnsw", "auto"), default="exact")
    p.add_argument("--dense_max_len", type=int, default=65536, help="longer rows skip dense (quadratic)")
    add_attention_row_flags(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    return p.parse_args(argv)


class PartTimer:
    """Wraps the tiled path's functions for the lifetime of a `with` block; seconds per part."""

    def __init__(self, core, device):
        self.core, self.device = core, device
        self.seconds = dict.fromkeys(PARTS[:-1], 0.0)
        self.restore = []

    def timed(self, part, function):
        def wrapper(*args, **kwargs):
            synchronize(self.device)
            start = time.perf_counter()
            result = function(*args, **kwargs)
            synchronize(self.device)
            self.seconds[part] += time.perf_counter() - start
            return result
        return wrapper

    def __enter__(self):
        core = self.core
        retriever_of = ann_attention.build_retriever

        def timed_retriever(config, kind=None):
            retriever = retriever_of(config, kind)
            retriever.select = self.timed("selection", retriever.select)
            return retriever

        gather = ann_attention.BlockTables.gather
        select_blocks = core.select_blocks

        def select_and_gather(*args):
            before = self.seconds["selection"]
            synchronize(self.device)
            start = time.perf_counter()
            blocks = select_blocks(*args)
            synchronize(self.device)
            self.seconds["gather"] += time.perf_counter() - start - (self.seconds["selection"] - before)
            return blocks

        self.restore = [(ann_attention, "build_retriever", retriever_of), (ann_attention, "attend_tile", ann_attention.attend_tile),
                        (ann_attention.BlockTables, "gather", gather)]
        ann_attention.build_retriever = timed_retriever
        ann_attention.attend_tile = self.timed("attend", ann_attention.attend_tile)
        core.tile_queries = self.timed("queries", core.tile_queries)
        core.select_blocks = select_and_gather
        return self

    def __exit__(self, *exc):
        for owner, name, value in self.restore:
            setattr(owner, name, value)
        del self.core.tile_queries, self.core.select_blocks


def profile_row(args, settings, length):
    generator = torch.Generator(args.device).manual_seed(args.seed)
    q, k, v = random_qkv(settings, length, generator)
    rope = rope_at(settings, 0, length)
    ann = build_core(settings, f"ann_{args.retrieval}")
    calls = {"ann": lambda: ann(q, k, v, None, None, None, rope)}
    if length <= args.dense_max_len:
        dense = build_core(settings, "dense")
        calls["dense"] = lambda: dense(q, k, v, None, None, None, rope)
    with torch.no_grad():
        times = {name: median_ms(seconds) for name, seconds in time_interleaved(calls, 1, args.repeats, args.device).items()}
        profiles = []
        for _ in range(args.repeats):
            with PartTimer(ann, args.device) as timer:
                synchronize(args.device)
                start = time.perf_counter()
                calls["ann"]()
                synchronize(args.device)
                profiles.append((time.perf_counter() - start, timer.seconds))
    total, seconds = sorted(profiles, key=lambda profile: profile[0])[len(profiles) // 2]  # the median call's parts
    parts = {part: 1000 * value for part, value in seconds.items()}
    parts["rest"] = max(0.0, 1000 * total - sum(parts.values()))
    dense_ms = times.get("dense")
    row = {"seq_len": length, "retrieval": args.retrieval, "ann_ms": times["ann"], "dense_ms": dense_ms,
           "profiled_ms": 1000 * total, **{f"{part}_ms": ms for part, ms in parts.items()}}
    if dense_ms:
        row["ratio"] = row["ann_ms"] / dense_ms
        row["ratio_without_selection"] = row["ann_ms"] * (1 - parts["selection"] / (1000 * total)) / dense_ms
    return row


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    settings = vars(args)
    rows = []
    for length in sorted(args.lengths):
        rows.append(profile_row(args, settings, length))
        print(f"{length}: ANN {rows[-1]['ann_ms']:.1f} ms, " + ", ".join(f"{p} {rows[-1][p + '_ms']:.1f}" for p in PARTS), flush=True)
    columns = [("seq_len", "seq_len", "{}"), ("dense ms", "dense_ms", "{:.1f}"), ("ANN ms", "ann_ms", "{:.1f}"),
               ("ANN / dense", "ratio", "{:.3f}")]
    columns += [(f"{part} ms", f"{part}_ms", "{:.1f}") for part in PARTS]
    columns += [("without selection / dense", "ratio_without_selection", "{:.3f}")]
    print()
    print(format_table(rows, columns))
    if args.json:
        config = {key: value for key, value in vars(args).items() if key != "json"}
        write_json(args.json, {**config, "machine": machine_info(args.device)}, rows)


if __name__ == "__main__":
    sys.exit(main())
