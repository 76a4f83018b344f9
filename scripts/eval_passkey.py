"""Passkey retrieval: can the model find a 5-digit key hidden at some depth of a long, boring prompt?

    python scripts/eval_passkey.py --load out/long_ann --lengths 512 1024 2048 4096
    python scripts/eval_passkey.py --load out/long_ann --attn ann --retrieval hnsw --lengths 65536 \\
        --depths 0.5 --threads 1 --json out/passkey_hnsw.json
    python scripts/eval_passkey.py --load out/long_dense --trials 10 --lang zh
    torchrun --standalone --nproc_per_node 2 scripts/eval_passkey.py --load out/long_ann --lengths 262144

The prompt is the Landmark Attention passkey test, worded exactly like the documents of
dataset/sample/passkey_long.jsonl (both come from evaluation/passkey.py): the instruction, the
filler repeated, the key line at the requested depth, more filler, then the question:

    There is an important info hidden ... The grass is green. ... There and back again. ...
    The pass key is 71432. Remember it. 71432 is the pass key. The grass is green. ...
    What is the pass key? The pass key is

A trial counts as correct when the first integer of the greedy continuation equals the key.
Prompts are built to a target length in tokens by choosing how many filler sentences to use, and
the depth (0 = right after the instruction, 1 = right before the question) is a fraction of them.
Generation goes through model.stream_generate, which prefills the prompt through the KV cache in
--prefill_chunk tokens at a time, so memory stays bounded at 64k-131k tokens. Under torchrun (ANN
attention only) each prompt is split by position over the ranks, one shard of the KV cache each
(model/context_parallel.py); rank 0 prints and writes, with every rank's peak RSS.

--load takes a model folder, an out dir or a checkpoint .pt (evaluation/loading.py), and
--attn/--retrieval switch the same weights between dense and ANN attention.
--json PATH writes {"config", "rows", "peak_rss_mb", "peak_rss_mb_per_rank"} and a plot next to it (PATH with .png).
Exit codes: 0 done, 2 bad arguments or nothing loadable.
"""

import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from common.cpu_memory import retain_freed_memory
from evaluation.loading import add_run_arguments, apply_run_arguments, load_model, resolve_load_path
from evaluation.passkey import PASSKEY_TEXTS, build_prompt, digits_right, parse_answer, random_key
from evaluation.trials import join_trial_group, peak_rss_mb, ranks_peak_rss_mb, run_trial, spread_depths
from model.config import ATTN_IMPLS, RETRIEVERS

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


# ----------------------------------------------------------------------------- evaluation


def evaluate(model, tokenizer, lengths, depths, args, group=None):
    """One trial per (length, depth), keys from one seeded RNG -> rows for the table and the JSON.
    With a context-parallel group each prompt is sharded over its ranks.

    The keys depend only on --seed, so dense and ANN runs with the same seed see the same prompts.
    """
    config = model.config
    retrieval = config.ann_retrieval if config.attn_impl == "ann" else None
    rng = random.Random(args.seed)
    rows = []
    for length in lengths:
        if length > config.max_position_embeddings:
            print(f"note: {length} tokens is beyond the model's {config.max_position_embeddings} positions")
        for depth in depths:
            key = random_key(rng)
            prompt_ids = build_prompt(tokenizer, length, depth, key, args.lang)
            text, prefill_s, total_s = run_trial(model, tokenizer, prompt_ids, args.prefill_chunk,
                                                 args.max_new_tokens, group)
            correct = parse_answer(text) == key
            print(f"length {length:>7} ({len(prompt_ids)} tokens) depth {depth:.2f} key {key} -> {text!r} "
                  f"{'ok' if correct else 'wrong'}, prefill {prefill_s:.2f}s, total {total_s:.2f}s", flush=True)
            rows.append({
                "length": length, "depth": depth, "attn": config.attn_impl, "retrieval": retrieval,
                "accuracy": float(correct), "trials": 1, "key": key, "answer": text, "prompt_tokens": len(prompt_ids),
                "prefill_seconds": round(prefill_s, 4), "seconds_per_trial": round(total_s, 4),
            })
    return rows


def print_table(rows):
    """Per length, averaged over depths: accuracy, the fraction of key digits in place, seconds per trial."""
    print(f"\n{'length':>8} {'accuracy':>9} {'digits':>7} {'trials':>7} {'prefill s':>10} {'s/trial':>8}")
    for length in dict.fromkeys(row["length"] for row in rows):
        group = [row for row in rows if row["length"] == length]
        trials = sum(row["trials"] for row in group)
        accuracy = sum(row["accuracy"] * row["trials"] for row in group) / trials
        digits = np.mean([digits_right(row["key"], row["answer"]) / len(str(row["key"])) for row in group])
        prefill = np.mean([row["prefill_seconds"] for row in group])
        seconds = np.mean([row["seconds_per_trial"] for row in group])
        print(f"{length:>8} {accuracy:>9.2f} {digits:>7.2f} {trials:>7} {prefill:>10.2f} {seconds:>8.2f}")
    print(f"peak RSS {peak_rss_mb():.0f} MB")


def plot(rows, title, png_path):
    """Heatmap of accuracy by depth and length, and mean accuracy by length."""
    lengths = sorted({row["length"] for row in rows})
    depths = sorted({row["depth"] for row in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for row in rows:
        grid[depths.index(row["depth"]), lengths.index(row["length"])] = row["accuracy"]
    fig, (heat, line) = plt.subplots(1, 2, figsize=(11, 4))
    image = heat.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
    heat.set_xticks(range(len(lengths)), [str(length) for length in lengths], rotation=45)
    heat.set_yticks(range(len(depths)), [f"{depth:.2f}" for depth in depths])
    heat.set_xlabel("prompt length (tokens)")
    heat.set_ylabel("key depth")
    fig.colorbar(image, ax=heat, label="accuracy")
    line.plot(lengths, np.nanmean(grid, axis=0), marker="o")
    line.set_xscale("log", base=2)
    line.set_xticks(lengths, [str(length) for length in lengths])
    line.minorticks_off()
    line.set_ylim(-0.05, 1.05)
    line.set_xlabel("prompt length (tokens)")
    line.set_ylabel("accuracy (mean over depths)")
    line.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = OneLineParser(description="MiniMind passkey retrieval evaluation")
    p.add_argument("--load", default="out/pretrain/model", help="model folder, out dir or checkpoint .pt")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="prompt lengths in tokens")
    spread = p.add_mutually_exclusive_group()
    spread.add_argument("--depths", type=float, nargs="+", default=None,
                        help=f"key depths in [0, 1], one trial each (default {' '.join(map(str, DEFAULT_DEPTHS))})")
    spread.add_argument("--trials", type=int, default=None, help="trials per length, depths spread evenly over 0..1")
    p.add_argument("--lang", choices=sorted(PASSKEY_TEXTS), default="en")
    p.add_argument("--attn", choices=ATTN_IMPLS, default=None, help="override the model's attention")
    p.add_argument("--retrieval", choices=RETRIEVERS, default=None, help="override the ANN block retrieval")
    p.add_argument("--prefill_chunk", type=int, default=4096, help="prompt tokens per prefill step; 0 = all at once")
    p.add_argument("--max_new_tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="seeds the keys")
    add_run_arguments(p)
    return p.parse_args(argv)


def validate_args(args):
    if any(length <= 0 for length in args.lengths):
        raise UsageError(f"--lengths must be positive, got {args.lengths}")
    if args.depths is not None and not all(0.0 <= depth <= 1.0 for depth in args.depths):
        raise UsageError(f"--depths must lie in [0, 1], got {args.depths}")
    if args.trials is not None and args.trials <= 0:
        raise UsageError(f"--trials must be positive, got {args.trials}")
    if args.prefill_chunk < 0 or args.max_new_tokens <= 0:
        raise UsageError("--prefill_chunk must be >= 0 and --max_new_tokens > 0")


def trial_depths(args):
    if args.trials is not None:
        return spread_depths(args.trials)
    return list(args.depths or DEFAULT_DEPTHS)


def main(argv=None):
    transformers_logging.disable_progress_bar()
    retain_freed_memory()
    try:
        args = parse_args(argv)
        validate_args(args)
        apply_run_arguments(args)
        path = resolve_load_path(args.load)
        model, tokenizer = load_model(path, args.attn, args.retrieval, torch.device(args.device))
        depths = trial_depths(args)
        for length in sorted(set(args.lengths)):
            try:
                build_prompt(tokenizer, length, 0.0, 10000, args.lang)
            except ValueError as error:
                raise UsageError(f"--lengths: {error}") from None
        group = join_trial_group(model.config, path)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    config = model.config
    attention = config.attn_impl
    if config.attn_impl == "ann":
        attention += (f" (window {config.ann_window}, blocks of {config.ann_block_size}, top {config.ann_top_n}, "
                      f"{config.ann_retrieval} retrieval)")
    num_parameters = sum(p.numel() for p in model.parameters())
    sharding = f", sharded over {group.size} ranks" if group else f", prefill chunk {args.prefill_chunk or 'whole prompt'}"
    print(f"model: {path}, {num_parameters / 1e6:.2f}M parameters, {attention} attention, "
          f"{torch.get_num_threads()} threads{sharding}")
    rows = evaluate(model, tokenizer, args.lengths, depths, args, group)
    print_table(rows)
    peak_per_rank = ranks_peak_rss_mb(group)

    if args.json and not (group and group.rank):
        json_path = Path(args.json)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        run_config = {
            "load": str(path), "attn": config.attn_impl, "retrieval": config.ann_retrieval,
            "ann_window": config.ann_window, "ann_block_size": config.ann_block_size, "ann_top_n": config.ann_top_n,
            "hnsw_m": config.hnsw_m, "hnsw_ef_search": config.hnsw_ef_search,
            "parameters": num_parameters, "lang": args.lang, "lengths": args.lengths, "depths": depths,
            "prefill_chunk": args.prefill_chunk, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "threads": torch.get_num_threads(), "device": args.device, "ranks": group.size if group else 1,
        }
        result = {"config": run_config, "rows": rows, "peak_rss_mb": max(peak_per_rank), "peak_rss_mb_per_rank": peak_per_rank}
        json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        title = f"passkey retrieval ({attention}): {path}"
        short = f"{config.attn_impl}, {config.ann_retrieval}" if config.attn_impl == "ann" else config.attn_impl
        plot(rows, title if len(title) < 90 else f"passkey retrieval ({short}): {path}",
             json_path.with_suffix(".png"))
        print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
