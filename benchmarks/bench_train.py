"""Whole-model training throughput: dense vs ANN attention, tokens per second of optimizer steps.

One step = forward + backward + AdamW step (trainer/optim.py's optimizer) on random token
ids; every implementation sees the same ids. The batch size is --tokens_per_step / seq_len, so a
step holds the same number of tokens at every length and tokens/s compares directly. Reported:
the median over --steps timed steps after --warmup untimed ones, and the peak memory of the
row (model, optimizer state, activations; see benchmarks/common.py), measured in a fresh
process per row; the implementations of one length are then timed in one fresh process, their
steps taking turns, so that their ratio is not at the mercy of the machine's drift.

    python benchmarks/bench_train.py --json docs/bench/train_cpu.json
    python benchmarks/bench_train.py --device cuda --dtype bfloat16 --preset small --json docs/bench/train_cuda.json
"""

import argparse
import contextlib
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    Extrapolator,
    PeakMemory,
    add_allocator_flag,
    apply_allocator,
    format_table,
    machine_info,
    measure_group,
    median_ms,
    plot_panels,
    png_path_for,
    set_threads,
    skip_reason,
    synchronize,
    time_interleaved,
    write_json,
)
from model.config import PRESETS, MiniMindConfig
from model.model import MiniMindForCausalLM
from trainer.optim import build_optimizer

IMPLS = ("dense", "ann_exact", "ann_hnsw", "ann_auto")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=["dense", "ann_exact"])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--tokens_per_step", type=int, default=8192, help="batch size = this / seq_len")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps; the median is reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="bfloat16: autocast")
    p.add_argument("--max_row_s", type=float, default=120.0, help="skip rows estimated to take longer")
    p.add_argument("--seed", type=int, default=0)
    add_allocator_flag(p)
    p.add_argument("--json", default="docs/bench/train.json")
    p.add_argument("--png", default=None, help="default: the --json path with .png")
    args = p.parse_args(argv)
    for length in args.lengths:
        if length < 2 or args.tokens_per_step % length:
            p.error(f"--tokens_per_step {args.tokens_per_step} must be a multiple of every length (got {length})")
    return args


def training_step(settings, impl, length):
    """One implementation's model, optimizer and data -> (a call that runs the next optimizer step, batch)."""
    device = settings["device"]
    torch.manual_seed(settings["seed"])
    config = MiniMindConfig.from_preset(
        settings["preset"],
        attn_impl="dense" if impl == "dense" else "ann",
        ann_retrieval="exact" if impl == "dense" else impl.removeprefix("ann_"),
        max_position_embeddings=max(length, MiniMindConfig().max_position_embeddings),
    )
    model = MiniMindForCausalLM(config).to(device).train()
    optimizer = build_optimizer(model, learning_rate=1e-4)
    batch = settings["tokens_per_step"] // length
    generator = torch.Generator().manual_seed(settings["seed"])
    total_steps = settings["warmup"] + settings["steps"]
    data = torch.randint(3, config.vocab_size, (total_steps, batch, length), generator=generator).to(device)
    autocast = (
        torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
        if settings["dtype"] == "bfloat16"
        else contextlib.nullcontext()
    )
    step_index = [0]

    def step():
        input_ids = data[step_index[0] % total_steps]
        with autocast:
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_index[0] += 1

    return step, batch


def measure_memory(settings, impl, *, length):
    """One row's peak memory (model, optimizer state, activations), in its own process: two
    steps, the first of which creates AdamW's state."""
    set_threads(settings["threads"])
    memory = PeakMemory(settings["device"])
    step, batch = training_step(settings, impl, length)
    for _ in range(2):
        step()
    synchronize(settings["device"])
    return {"batch": batch, "peak_mb": memory.peak_mb()}


def measure_times(settings, impls, *, length):
    """Every implementation at one length, in one process, their optimizer steps taking turns:
    {impl: {tokens_per_s, step_ms, min_row_s}} from the median step."""
    set_threads(settings["threads"])
    steps = {impl: training_step(settings, impl, length)[0] for impl in impls}
    times = time_interleaved(steps, settings["warmup"], settings["steps"], settings["device"], settings["max_row_s"])
    results = {}
    for impl, seconds in times.items():
        step_ms = median_ms(seconds)
        results[impl] = {
            "tokens_per_s": settings["tokens_per_step"] / (step_ms / 1000),
            "step_ms": step_ms,
            "min_row_s": (settings["warmup"] + 1) * step_ms / 1000,
        }
    return results


def main(argv=None):
    args = parse_args(argv)
    apply_allocator(args.allocator)
    settings = vars(args)
    rows, skipped, failures = [], [], 0
    # Tokens per step are fixed, so a step's cost grows at most linearly with seq_len.
    time_estimates = Extrapolator(min_exponent=0.0, max_exponent=1.0)

    def skip(impl, length, reason):
        print(f"skipped {impl:9s} {length:6d}: {reason}", flush=True)
        skipped.append({"impl": impl, "seq_len": length, "reason": reason})

    for length in sorted(args.lengths):
        results, failed = measure_group(
            args.impls,
            lambda impl: skip_reason(time_estimates.predict(impl, length), args.max_row_s),
            partial(measure_memory, settings, length=length),
            partial(measure_times, settings, length=length),
            lambda impl, reason: skip(impl, length, reason),
        )
        failures += failed
        for impl, (memory, times) in results.items():
            time_estimates.add(impl, length, times.pop("min_row_s"))
            rows.append({"impl": impl, "seq_len": length, **memory, **times})
            print(f"{impl:9s} {length:6d}: {times['tokens_per_s']:9.0f} tokens/s  {memory['peak_mb']:8.1f} MB",
                  flush=True)

    rows.sort(key=lambda row: (row["seq_len"], IMPLS.index(row["impl"])))
    dense = {row["seq_len"]: row["tokens_per_s"] for row in rows if row["impl"] == "dense"}
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / dense[row["seq_len"]] if row["seq_len"] in dense else None
    print()
    print(format_table(rows, [
        ("impl", "impl", "{}"), ("seq_len", "seq_len", "{}"), ("batch", "batch", "{}"),
        ("tokens/s", "tokens_per_s", "{:.0f}"), ("step_ms", "step_ms", "{:.1f}"), ("peak_mb", "peak_mb", "{:.1f}"),
        ("ratio vs dense", "ratio", "{:.3f}"),
    ]))
    config = {key: value for key, value in settings.items() if key not in ("json", "png")}
    config["machine"] = machine_info(args.device)
    write_json(args.json, config, rows, skipped=skipped)
    panels = []
    for metric, label in (("tokens_per_s", "tokens / s"), ("peak_mb", "peak MB")):
        lines = {impl: [(r["seq_len"], r[metric]) for r in rows if r["impl"] == impl] for impl in IMPLS}
        panels.append((f"training: {metric}", "seq_len", label, lines))
    title = (f"training, preset {args.preset}, {args.tokens_per_step} tokens/step, "
             f"{args.device} {args.dtype} {args.threads} threads")
    plot_panels(png_path_for(args.json, args.png), title, panels)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
