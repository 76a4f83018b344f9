"""Attention cores alone: dense causal SDPA vs ANN attention (exact / hnsw / auto retrieval), and
FlexAttention baselines on request (--impls ... flex_causal flex_ann).

Same random q/k/v for every implementation (batch --batch, --heads query heads, --kv_heads kv
heads, head dim --head_dim); dense is model.model.dense_attention (GQA by repeat_interleave, then
causal SDPA), ANN is model.ann_attention.AnnAttention with the config's window / block / top_n.
flex_causal is torch's compiled flex_attention under a causal block mask, flex_ann the keys ANN
attention reads with true positions as a block-sparse flex_attention mask (benchmarks/flex_cores.py;
fwd and fwd_bwd rows only, compiled in each process's first, untimed call).
Modes:
    fwd       one causal pass over seq_len tokens, no grad;
    fwd_bwd   the same with backward to q, k, v (only up to --max_bwd_len);
    decode    per-token latency of one new token against a cache of seq_len tokens. The ANN
              cache is built by chunked prefill through the core (it needs the block summaries
              and HNSW graphs a real prefill leaves); the dense KV buffer is filled by writing the
              random keys into it, since no dense attention is needed to make its state. Both
              caches are reserved for the whole length up front, as model.generate reserves them.
Each row's peak memory is measured in a fresh process of its own; the implementations of one
(mode, length) are then timed together in one fresh process, taking turns call by call, so that
their ratio is not at the mercy of the machine's drift (benchmarks/common.py). A row is
skipped, with the reason printed, when its memory or time extrapolated from the shorter rows of
its series would exceed --mem_limit_gb or --max_row_s.

    python benchmarks/bench_attention.py --json docs/bench/attention_cpu.json
    python benchmarks/bench_attention.py --device cuda --dtype bfloat16 \
        --impls dense ann_exact ann_auto flex_causal flex_ann --json docs/bench/attention_cuda.json
"""

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    Extrapolator,
    PeakMemory,
    add_allocator_flag,
    add_attention_row_flags,
    apply_allocator,
    build_core,
    format_table,
    machine_info,
    measure_group,
    median_ms,
    plot_panels,
    png_path_for,
    random_qkv,
    rope_at,
    set_threads,
    skip_reason,
    synchronize,
    time_interleaved,
    write_json,
)
from common.cli import DTYPES

IMPLS = ("dense", "ann_exact", "ann_hnsw", "ann_auto", "ann_pruned", "flex_causal", "flex_ann")
DEFAULT_IMPLS = IMPLS[:4]
MODES = ("fwd", "fwd_bwd", "decode")


def flex_reason_to_skip(impl, mode, device):
    """Why a FlexAttention row cannot run (benchmarks/flex_cores.py), or None."""
    if not impl.startswith("flex_"):
        return None
    if mode == "decode":
        return "FlexAttention baselines have no KV cache: fwd and fwd_bwd rows only"
    if mode == "fwd_bwd" and torch.device(device).type == "cpu":
        return "torch has no FlexAttention backward on CPU"
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144, 1048576])
    p.add_argument("--decode_lengths", type=int, nargs="+", default=[2048, 8192, 32768, 131072, 1048576])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS))
    p.add_argument("--max_bwd_len", type=int, default=8192, help="fwd_bwd rows only up to this length")
    add_attention_row_flags(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed calls (decode: steps) before timing")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row; the median is reported")
    p.add_argument("--decode_steps", type=int, default=20, help="timed decode steps per row")
    p.add_argument("--prefill_chunk", type=int, default=2048, help="tokens per prefill call when building a cache")
    p.add_argument("--max_prefill_len", type=int, default=131072,
                   help="longer ANN decode caches are written (keys, values, block summaries), not prefilled")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem_limit_gb", type=float, default=16.0, help="skip rows estimated to need more")
    p.add_argument("--max_row_s", type=float, default=90.0, help="skip rows estimated to take longer")
    p.add_argument("--seed", type=int, default=0)
    add_allocator_flag(p)
    p.add_argument("--json", default="docs/bench/attention.json")
    p.add_argument("--png", default=None, help="default: the --json path with .png")
    return p.parse_args(argv)


def pass_call(settings, impl, mode, length):
    """The fwd / fwd_bwd call of one implementation on the row's inputs (the same for every impl)."""
    device = settings["device"]
    generator = torch.Generator(device).manual_seed(settings["seed"])
    q, k, v = random_qkv(settings, length, generator, requires_grad=mode == "fwd_bwd")
    core = build_core(settings, impl)
    rope = rope_at(settings, 0, length)
    if mode == "fwd":

        def call():
            with torch.no_grad():
                core(q, k, v, None, None, None, rope)

    else:
        upstream = torch.randn(q.shape, generator=generator, device=device, dtype=q.dtype)

        def call():
            q.grad = k.grad = v.grad = None
            core(q, k, v, None, None, None, rope).backward(upstream)

    call.core = core
    return call


def decode_call(settings, impl, length):
    """One implementation's cache of `length` tokens -> (a call decoding the next token, the
    PeakMemory started before the measured prefill, {prefill_ms, prefill_peak_mb, kv_cache_mb}).

    The ANN cache is built by chunked prefill through the core up to --max_prefill_len tokens;
    beyond, by writing what a prefill leaves in it: keys, values and block summaries (the prefill's
    exact selection is quadratic in the length, and its outputs are not needed here; HNSW graphs
    grow in the first, untimed, decode step). The dense KV buffer is filled by writing the keys. A short prefill into a throwaway cache comes first, as the timed modes warm up: the
    first calls' one-time allocations (thread pools, BLAS workspaces; ~60 MB on CPU) are not the
    prefill's.
    """
    device = settings["device"]
    generator = torch.Generator(device).manual_seed(settings["seed"])
    core = build_core(settings, impl)
    batch, chunk = settings["batch"], settings["prefill_chunk"]

    written = impl == "dense" or length > settings["max_prefill_len"]

    def prefill(cache, length):
        for begin in range(0, length, chunk):
            size = min(chunk, length - begin)
            q, k, v = random_qkv(settings, size, generator)
            starts = torch.full((batch,), begin, device=device)
            if impl == "dense":
                cache.write(k, v, starts)
            elif written:
                cache.write(k, v, starts)
                cache.update_summaries(begin, begin + size)
            else:
                with torch.no_grad():
                    core(q, k, v, starts, starts + size, cache, rope_at(settings, begin, size))
        synchronize(device)

    prefill(core.new_layer_cache(reserve=chunk), min(chunk, length))
    memory = PeakMemory(device)
    # Reserved for prompt + generated tokens, as model.generate does: no regrowth copies.
    cache = core.new_layer_cache(reserve=length + settings["warmup"] + settings["decode_steps"])
    started = time.perf_counter()
    prefill(cache, length)
    prefill_s = time.perf_counter() - started
    element_bytes = torch.finfo(DTYPES[settings["dtype"]]).bits // 8
    info = {
        "prefill_ms": None if written else 1000 * prefill_s,
        "cache_built": "written" if written else "prefill",
        "prefill_peak_mb": memory.peak_mb(),
        "kv_cache_mb": 2 * batch * settings["kv_heads"] * length * settings["head_dim"] * element_bytes / 2**20,
    }
    steps = [
        (*random_qkv(settings, 1, generator), rope_at(settings, length + i, 1))
        for i in range(settings["warmup"] + settings["decode_steps"])
    ]
    position = [length]

    def call():
        q, k, v, rope = steps[position[0] - length]
        starts = torch.full((batch,), position[0], device=device)
        with torch.no_grad():
            core(q, k, v, starts, starts + 1, cache, rope)
        position[0] += 1

    return call, memory, info


def measure_memory(settings, impl, *, mode, length):
    """One row's memory, in its own process: {peak_mb} (decode: plus the prefill's time and peak
    and the size of the keys and values). See benchmarks/common.py for what peak_mb counts."""
    set_threads(settings["threads"])
    if mode == "decode":
        call, memory, info = decode_call(settings, impl, length)
        for _ in range(settings["warmup"] + 1):
            call()
        return {"peak_mb": memory.peak_mb(), **info}
    call = pass_call(settings, impl, mode, length)
    if impl.startswith("flex_"):
        call()  # compilation's own memory is not the row's
    memory = PeakMemory(settings["device"])
    call()
    synchronize(settings["device"])
    if impl == "flex_ann":
        return {"peak_mb": memory.peak_mb(), "tiles_vs_causal": call.core.tile_fraction}
    return {"peak_mb": memory.peak_mb()}


def measure_times(settings, impls, *, mode, length):
    """Every implementation of one (mode, length), in one process, timed in turns (interleaved):
    {impl: {ms, mean_ms, min_row_s}}, ms per call (decode: per token), the median of the timed calls and
    their mean (a decode row's mean counts the steps that grow an HNSW graph by a block, which the
    median leaves out)."""
    set_threads(settings["threads"])
    if mode == "decode":
        calls = {impl: decode_call(settings, impl, length)[0] for impl in impls}
        repeats = settings["decode_steps"]
    else:
        calls = {impl: pass_call(settings, impl, mode, length) for impl in impls}
        repeats = settings["repeats"]
    times = time_interleaved(calls, settings["warmup"], repeats, settings["device"], settings["max_row_s"])
    return {
        impl: {"ms": median_ms(seconds), "mean_ms": 1000.0 * statistics.mean(seconds), "min_row_s": (settings["warmup"] + 1) * statistics.median(seconds)}
        for impl, seconds in times.items()
    }


def planned_groups(args):
    """(mode, length) pairs in the order they run; each times every implementation together."""
    groups = []
    for mode in args.modes:
        lengths = sorted(args.decode_lengths if mode == "decode" else args.lengths)
        if mode == "fwd_bwd":
            dropped = [length for length in lengths if length > args.max_bwd_len]
            if dropped:
                print(f"fwd_bwd only up to --max_bwd_len {args.max_bwd_len}: not run at {dropped}")
            lengths = [length for length in lengths if length <= args.max_bwd_len]
        groups += [(mode, length) for length in lengths]
    return groups


def add_ratios(rows):
    dense = {(row["mode"], row["seq_len"]): row["ms"] for row in rows if row["impl"] == "dense"}
    for row in rows:
        reference = dense.get((row["mode"], row["seq_len"]))
        row["ratio"] = None if reference is None else row["ms"] / reference


def plot(rows, png_path, title):
    panels = []
    for metric, label in (("ms", "ms per call (decode: per token)"), ("peak_mb", "peak MB")):
        for mode in MODES:
            mode_rows = [row for row in rows if row["mode"] == mode]
            if mode_rows:
                lines = {impl: [(r["seq_len"], r[metric]) for r in mode_rows if r["impl"] == impl] for impl in IMPLS}
                panels.append((f"{mode}: {metric}", "seq_len (decode: cached tokens)", label, lines))
    plot_panels(png_path, title, panels)


def main(argv=None):
    args = parse_args(argv)
    apply_allocator(args.allocator)
    settings = vars(args)
    rows, skipped, failures = [], [], 0
    time_estimates = Extrapolator()
    # A decode row's prefill apart: rows past --max_prefill_len write their cache instead.
    prefill_estimates = Extrapolator()

    def estimated_s(impl, mode, length):
        timed = time_estimates.predict((impl, mode), length)
        if timed is None or mode != "decode" or length > args.max_prefill_len:
            return timed
        return timed + (prefill_estimates.predict((impl, mode), length) or 0)
    # A decode row holds a cache, linear in its length; a pass may hold (dense) a quadratic mask.
    memory_estimates = {mode: Extrapolator(max_exponent=1.0 if mode == "decode" else 2.0) for mode in MODES}

    def skip(impl, mode, length, reason):
        print(f"skipped {impl:9s} {mode:7s} {length:7d}: {reason}", flush=True)
        skipped.append({"impl": impl, "mode": mode, "seq_len": length, "reason": reason})

    for mode, length in planned_groups(args):
        results, failed = measure_group(
            args.impls,
            lambda impl: flex_reason_to_skip(impl, mode, args.device) or skip_reason(
                estimated_s(impl, mode, length), args.max_row_s,
                memory_estimates[mode].predict((impl, mode), length), args.mem_limit_gb),
            partial(measure_memory, settings, mode=mode, length=length),
            partial(measure_times, settings, mode=mode, length=length),
            lambda impl, reason: skip(impl, mode, length, reason),
        )
        failures += failed
        for impl, (memory, times) in results.items():
            # a row's cost for the extrapolation: its timed calls, and a decode row's prefill
            time_estimates.add((impl, mode), length, times.pop("min_row_s"))
            if memory.get("prefill_ms"):
                prefill_estimates.add((impl, mode), length, memory["prefill_ms"] / 1000)
            memory_estimates[mode].add((impl, mode), length, max(memory["peak_mb"], 1.0))
            rows.append({"impl": impl, "mode": mode, "seq_len": length, **times, **memory})
            print(f"{impl:9s} {mode:7s} {length:7d}: {times['ms']:10.3f} ms  {memory['peak_mb']:9.1f} MB", flush=True)

    rows.sort(key=lambda row: (MODES.index(row["mode"]), row["seq_len"], IMPLS.index(row["impl"])))
    add_ratios(rows)
    columns = [("impl", "impl", "{}"), ("mode", "mode", "{}"), ("seq_len", "seq_len", "{}"), ("ms", "ms", "{:.3f}"),
               ("mean ms", "mean_ms", "{:.3f}"), ("peak_mb", "peak_mb", "{:.1f}"), ("ratio vs dense", "ratio", "{:.3f}")]
    if any(row.get("tiles_vs_causal") is not None for row in rows):
        columns.append(("flex key tiles / causal", "tiles_vs_causal", "{:.3f}"))
    if any(row.get("kv_cache_mb") for row in rows):
        columns += [("prefill_ms", "prefill_ms", "{:.0f}"), ("prefill_peak_mb", "prefill_peak_mb", "{:.1f}"),
                    ("kv_cache_mb", "kv_cache_mb", "{:.1f}")]
    print()
    print(format_table(rows, columns))
    config = {key: value for key, value in settings.items() if key not in ("json", "png")}
    config["machine"] = machine_info(args.device)
    write_json(args.json, config, rows, skipped=skipped)
    title = (f"attention, b={args.batch} h={args.heads} g={args.kv_heads} d={args.head_dim} W={args.window} "
             f"B={args.block_size} top_n={args.top_n}, {args.device} {args.dtype} {args.threads} threads")
    plot(rows, png_path_for(args.json, args.png), title)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
