"""Needles in held-out prose: can the model return the numbers hidden at some depth of a long prompt?

    python scripts/eval_needles.py --load out/prose_ann --data_dir ../shared/data --threads 2 \\
        --json out/prose_ann/needles.json
    python scripts/eval_needles.py --load out/prose_ann --tasks single --langs zh --lengths 1048576 \\
        --trials 2 --retrievals exact
    python scripts/eval_needles.py --load out/prose_dense --lengths 4096 16384
    torchrun --standalone --nproc_per_node 2 scripts/eval_needles.py --load out/prose_ann --lengths 65536

Every task (single, multikey, multivalue: evaluation/needles.py, worded as the training documents of
scripts/make_prose_data.py) in every language, at every --lengths (tokens), with --trials depths
spread evenly over 0..1 (or --depths). Haystacks are cut from the held-out part of the corpus in
--data_dir (dataset/prose.py); a haystack longer than a language's held-out text continues with its
training text, and each trial records how many of its tokens were held out. With --passage_tokens N
the haystack is one held-out passage of N tokens repeated (the training mix's repeated haystacks); with
--distinct_digits no needle number holds a digit twice, in otherwise the same prompts. A trial's needles and
haystack depend only on --seed, the task, the language, the length and the trial's index, so every
model and retrieval sees the same prompts. An ANN model is evaluated with each of --retrievals on
the same weights; a dense model once, and only up to --dense_max_length.

The prompt goes through the KV cache --prefill_chunk tokens at a time (evaluation/trials.py). Under
torchrun (an ANN model only) each prompt is split by position over the ranks, which hold one shard
of the KV cache each (model/context_parallel.py); rank 0 prints and writes, and each row has
`ranks` and every rank's peak RSS (`peak_rss_mb_per_rank`). A trial is right when the first integer of the greedy answer is the asked number (multivalue: when
every number of the label is among the answer's integers).
--json PATH writes {"config", "rows", "trials"} (rows: task, lang, length, retrieval, seed (the
model's training seed, from its training_args.json), needle_seed, accuracy, trials, prefill_seconds,
answer_seconds, peak_rss_mb, ranks, peak_rss_mb_per_rank; a trial also has its answer and
value_token, the prompt index of the asked number's first token) and PATH with .png: accuracy by
length and depth, one panel per task, language and retrieval.
Exit codes: 0 done, 2 bad arguments or nothing loadable.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from common.cpu_memory import retain_freed_memory
from dataset.prose import DEFAULT_DATA_DIR, LANGS, heldout_stream, read_corpus
from evaluation.loading import (add_attention_overrides, add_run_arguments, apply_run_arguments, attention_overrides,
                                load_model, resolve_load_path, training_seed)
from evaluation.needles import (KEY_RANGE, TASKS, answer, answered_other_key, build_prompt, draw_needles, other_values,
                                score, shortest_prompt)
from evaluation.reports import plot_needles, write_results
from evaluation.selection import value_position
from evaluation.trials import join_trial_group, ranks_peak_rss_mb, run_trial, spread_depths, trial_rng
from model.config import RETRIEVERS

DEFAULT_LENGTHS = (4096, 16384, 65536, 262144, 1048576)


# ----------------------------------------------------------------------------- evaluation


def evaluate(models, model_seed, tokenizer, streams, args, depths, group=None):
    """Each (length, task, lang, depth) prompt built once and answered by every model
    ({retrieval or None: model}, the same weights trained with model_seed), sharded over a
    context-parallel group if one is given -> (summary rows, trial rows)."""
    rows, trial_rows = [], []
    for length in args.lengths:
        for task in args.tasks:
            for lang in args.langs:
                results = {retrieval: [] for retrieval in models}
                for index, depth in enumerate(depths):
                    rng = trial_rng(args.seed, task, lang, length, index)
                    needles = draw_needles(rng, task, lang, depth, num_keys=args.num_keys if task == "multikey" else None,
                                           distinct_digits=args.distinct_digits)
                    stream = streams[lang]
                    ids, span = build_prompt(tokenizer, stream, needles, length, rng.randrange(stream.rotate),
                                             args.passage_tokens or None)
                    max_new_tokens = len(tokenizer(answer(needles), add_special_tokens=False).input_ids) + 4
                    asked_token = value_position(tokenizer, ids, needles.values[0])
                    for retrieval, model in models.items():
                        if retrieval is None and length > args.dense_max_length:
                            continue
                        text, prefill_s, total_s = run_trial(model, tokenizer, ids, args.prefill_chunk, max_new_tokens, group)
                        correct = score(needles, text)
                        print(f"{task:<10} {lang} {length:>8} ({len(ids)} tokens, {span.heldout_tokens} held out) "
                              f"depth {depth:.2f} {retrieval or 'dense':<5} {needles.values} -> {text!r} "
                              f"{'ok' if correct else 'wrong'}, prefill {prefill_s:.2f}s, answer {total_s - prefill_s:.2f}s",
                              flush=True)
                        trial = {"task": task, "lang": lang, "length": length, "retrieval": retrieval,
                                 "selection": selection_of(model), "depth": depth,
                                 "seed": model_seed, "needle_seed": args.seed, "values": list(needles.values),
                                 "other_values": list(other_values(needles)), "answer": text,
                                 "correct": correct, "answered_other_key": answered_other_key(needles, text),
                                 "prompt_tokens": len(ids), "value_token": asked_token,
                                 "heldout_tokens": span.heldout_tokens,
                                 "wrapped": span.wrapped, "prefill_seconds": round(prefill_s, 4),
                                 "answer_seconds": round(total_s - prefill_s, 4)}
                        results[retrieval].append(trial)
                        trial_rows.append(trial)
                for retrieval, trials in results.items():
                    if trials:
                        rows.append(summary_row(trials, retrieval, ranks_peak_rss_mb(group)))
    return rows, trial_rows


def selection_of(model):
    """How an ANN model scores blocks (its ann_block_summary, and the layers that retrieve when not
    every layer does: "keys, layers 1"); None for a dense one."""
    config = model.config
    if config.attn_impl != "ann":
        return None
    if config.ann_retrieval_layers is None:
        return config.ann_block_summary
    return f"{config.ann_block_summary}, layers {' '.join(map(str, config.ann_retrieval_layers)) or 'none'}"


def summary_row(trials, retrieval, peak_rss_per_rank):
    first = trials[0]
    return {
        "task": first["task"], "lang": first["lang"], "length": first["length"], "retrieval": retrieval,
        "selection": first["selection"],
        "seed": first["seed"], "needle_seed": first["needle_seed"],
        "accuracy": float(np.mean([trial["correct"] for trial in trials])), "trials": len(trials),
        "answered_other_key": float(np.mean([trial["answered_other_key"] for trial in trials])),
        "prefill_seconds": round(float(np.mean([trial["prefill_seconds"] for trial in trials])), 4),
        "answer_seconds": round(float(np.mean([trial["answer_seconds"] for trial in trials])), 4),
        "heldout_fraction": round(sum(t["heldout_tokens"] for t in trials) / sum(t["prompt_tokens"] for t in trials), 4),
        # Each process's peak so far: lengths run in increasing order, so it is this length's peak.
        "peak_rss_mb": max(peak_rss_per_rank), "ranks": len(peak_rss_per_rank), "peak_rss_mb_per_rank": peak_rss_per_rank,
    }


def print_table(rows):
    print(f"\n{'task':<10} {'lang':<4} {'retrieval':<9} {'length':>8} {'accuracy':>9} {'trials':>7} {'other key':>9} "
          f"{'prefill s':>10} {'answer s':>9} {'held out':>9} {'peak MB':>8}")
    for row in rows:
        print(f"{row['task']:<10} {row['lang']:<4} {row['retrieval'] or 'dense':<9} {row['length']:>8} "
              f"{row['accuracy']:>9.2f} {row['trials']:>7} {row['answered_other_key']:>9.2f} "
              f"{row['prefill_seconds']:>10.2f} {row['answer_seconds']:>9.2f} "
              f"{row['heldout_fraction']:>9.2f} {row['peak_rss_mb']:>8.0f}")


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = OneLineParser(description="MiniMind needle retrieval in held-out prose")
    p.add_argument("--load", default="out/prose_ann/model", help="model folder, out dir or checkpoint .pt")
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder with kjv.txt, tinyshakespeare.txt, sanguo.txt")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prompt lengths in tokens")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--langs", nargs="+", choices=LANGS, default=list(LANGS))
    spread = p.add_mutually_exclusive_group()
    spread.add_argument("--depths", type=float, nargs="+", default=None, help="needle depths in [0, 1], one trial each")
    spread.add_argument("--trials", type=int, default=5, help="trials per task, language and length, depths spread over 0..1")
    p.add_argument("--num_keys", type=int, default=4, help="key sentences of a multikey prompt")
    p.add_argument("--retrievals", nargs="+", choices=[r for r in RETRIEVERS if r != "auto"], default=["exact", "hnsw"],
                   help="block retrievals an ANN model is evaluated with")
    p.add_argument("--dense_max_length", type=int, default=32768,
                   help="longest prompt a dense model is asked (its cost grows with the square of the length)")
    p.add_argument("--prefill_chunk", type=int, default=4096, help="prompt tokens per prefill step; 0 = all at once")
    p.add_argument("--seed", type=int, default=0, help="seeds the needles and haystacks")
    p.add_argument("--distinct_digits", action="store_true",
                   help="needle numbers with no digit twice; the prompts are otherwise those without it")
    p.add_argument("--passage_tokens", type=int, default=0,
                   help="haystack: one held-out passage of this many tokens repeated (0: held-out prose read on)")
    add_attention_overrides(p)
    add_run_arguments(p)
    return p.parse_args(argv)


def validate_args(args):
    if any(length <= 0 for length in args.lengths):
        raise UsageError(f"--lengths must be positive, got {args.lengths}")
    args.lengths = sorted(set(args.lengths))
    if args.depths is not None and not all(0.0 <= depth <= 1.0 for depth in args.depths):
        raise UsageError(f"--depths must lie in [0, 1], got {args.depths}")
    if args.depths is None and args.trials <= 0:
        raise UsageError(f"--trials must be positive, got {args.trials}")
    low, high = KEY_RANGE["multikey"]
    if not low <= args.num_keys <= high:
        raise UsageError(f"--num_keys must lie in {low}..{high}, got {args.num_keys}")
    if args.prefill_chunk < 0 or args.dense_max_length <= 0:
        raise UsageError("--prefill_chunk must be >= 0 and --dense_max_length > 0")
    if args.passage_tokens < 0:
        raise UsageError(f"--passage_tokens must be >= 0, got {args.passage_tokens}")


def check_lengths(tokenizer, args):
    for task in args.tasks:
        for lang in args.langs:
            least = shortest_prompt(tokenizer, task, lang)
            if args.lengths[0] < least:
                raise UsageError(f"--lengths {args.lengths[0]} is shorter than the {lang} {task} template ({least} tokens)")


def load_models(path, args):
    """{retrieval: model} for an ANN model (the same weights once per retrieval), {None: model} for
    a dense one, and the tokenizer."""
    device = torch.device(args.device)
    overrides = attention_overrides(args)
    model, tokenizer = load_model(path, None, args.retrievals[0], device, overrides)
    if model.config.attn_impl != "ann":
        return {None: model}, tokenizer
    others = {retrieval: load_model(path, None, retrieval, device, overrides)[0] for retrieval in args.retrievals[1:]}
    return {args.retrievals[0]: model, **others}, tokenizer


def main(argv=None):
    transformers_logging.disable_progress_bar()
    retain_freed_memory()
    try:
        args = parse_args(argv)
        validate_args(args)
        apply_run_arguments(args)
        corpus = read_corpus(args.data_dir)
        path = resolve_load_path(args.load)
        models, tokenizer = load_models(path, args)
        check_lengths(tokenizer, args)
        group = join_trial_group(next(iter(models.values())).config, path)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    config = next(iter(models.values())).config
    depths = list(args.depths) if args.depths is not None else spread_depths(args.trials)
    streams = {lang: heldout_stream(corpus, lang, tokenizer) for lang in args.langs}
    num_parameters = sum(p.numel() for p in next(iter(models.values())).parameters())
    sharding = f", sharded over {group.size} ranks" if group else f", prefill chunk {args.prefill_chunk or 'whole prompt'}"
    print(f"model: {path}, {num_parameters / 1e6:.2f}M parameters, {config.attn_impl} attention, "
          f"{torch.get_num_threads()} threads{sharding}")
    seed = training_seed(path)
    rows, trial_rows = evaluate(models, seed, tokenizer, streams, args, depths, group)
    print_table(rows)

    if args.json and not (group and group.rank):
        run_config = {
            "load": str(path), "attn": config.attn_impl, "ann_window": config.ann_window,
            "ann_block_size": config.ann_block_size, "ann_top_n": config.ann_top_n,
            "ann_block_summary": config.ann_block_summary, "ann_retrieval_layers": config.ann_retrieval_layers,
            "ann_logn_length": config.ann_logn_length,
            "ann_batch_distractors": config.ann_batch_distractors, "hnsw_m": config.hnsw_m,
            "hnsw_ef_construction": config.hnsw_ef_construction, "hnsw_ef_search": config.hnsw_ef_search,
            "hnsw_keys_per_head": config.hnsw_keys_per_head, "parameters": num_parameters, "data_dir": args.data_dir,
            "lengths": args.lengths, "depths": depths, "tasks": args.tasks, "langs": args.langs,
            "num_keys": args.num_keys, "prefill_chunk": args.prefill_chunk, "needle_seed": args.seed, "model_seed": seed,
            "passage_tokens": args.passage_tokens, "distinct_digits": args.distinct_digits,
            "threads": torch.get_num_threads(), "device": args.device, "ranks": group.size if group else 1,
        }
        write_results(args.json, {"config": run_config, "rows": rows, "trials": trial_rows}, plot_needles,
                      f"needles in held-out prose: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
