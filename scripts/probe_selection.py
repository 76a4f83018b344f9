"""Does the model's block selection find the needle? Where the block holding a needle's number ranks
among the blocks the answering query could retrieve, in every layer.

    python scripts/probe_selection.py --load out/prose_ann/model --lengths 400 1024 4096 --trials 8
    python scripts/probe_selection.py --load out/prose_ann/model --lengths 16384 --langs zh --json out/selection.json

The prompts are scripts/eval_needles.py's `single` prompts, or with --task multikey its
multikey ones (--num_keys key sentences; the block ranked holds the asked label's number), or with
--task multivalue its multivalue ones (the block ranked holds the label's first number); the same
--seed gives the same needles and haystacks. Each is prefilled once; the query of its last token, which predicts the answer's
first digit, ranks the block holding the number's first token among its candidate blocks three ways
(evaluation/selection.py): by the summary score that selection uses, by the sum over a GQA group's
heads of the largest q . k in the block (a perfectly tight summary), and by the attention mass the
group would give the block if every candidate were visible; with --hnsw_keys also as "keys"
selection through HNSW does: per kv head a graph over the candidate keys, each query head's
hnsw_keys_per_head best keys, the blocks holding them scored by their best keys, the others
never offered (evaluation/selection.py hnsw_key_scores). With --answer the answer is teacher-forced
after the prompt and every answer token's query is probed: the block ranked is the one holding the
prompt token it copies (a digit: the same digit of the number; the space or end mark around the
number: its first or last digit), and the table adds the model's probability of that answer token
(`p_correct`) and the share of prompts where it is the most likely one (`argmax`): where the copy
breaks, and whether selection lost the block there. A multivalue answer lists every number of the
label, so the k-th number's tokens are labelled n<k>.d1, ... (evaluation/selection.copy_targets),
and each later number adds a row `n<k>.prev`: the query that predicts its first digit ranks the
block of the number before it, and `p_correct` is the probability of repeating that number's first
digit (prompts where the two numbers open with the same digit are left out of that row): does the
query that should move on to the next number still find, and copy, the one it has written? The model prefills with --retrieval
(exact, or hnsw for lengths where scoring every key is too slow). Per length, language and layer the
table gives the mean candidates, the median rank and the share of (trial, kv head) pairs with the
block in the top_n under each ranking, and `bounds_must_score`: the mean share of candidate
blocks whose bounds score reaches the top_n-th best-key score, which an exact best-key search that
prunes by bounds would still score in full. A block that the queries rank high but the summaries do
not is lost to the summary; one that no ranking puts high, to the queries and keys.
--json PATH writes {"config", "rows"} and PATH with .png (share in top_n by length, per layer).
Exit codes: 0 done, 2 bad arguments, a missing text file, or a model that is not ANN.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from dataset.prose import DEFAULT_DATA_DIR, LANGS, heldout_stream, read_corpus
from evaluation.loading import (add_attention_overrides, add_run_arguments, apply_run_arguments, attention_overrides,
                                load_model, resolve_load_path)
from evaluation.needles import KEY_RANGE, TASKS, answer, build_prompt, draw_needles, shortest_prompt
from evaluation.reports import plot_selection, write_results
from evaluation.selection import (RANKINGS, block_scores, bounds_must_score, copy_targets, prefill, record_layers,
                                  target_ranks, teacher_forced, token_chances, value_position)
from evaluation.trials import spread_depths, trial_rng


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="ANN model folder, out dir or checkpoint .pt")
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder with kjv.txt, tinyshakespeare.txt, sanguo.txt")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt lengths in tokens")
    p.add_argument("--langs", nargs="+", choices=LANGS, default=list(LANGS))
    p.add_argument("--trials", type=int, default=8, help="prompts per language and length, depths spread over 0..1")
    p.add_argument("--task", choices=TASKS, default="single",
                   help="needle task of the prompts (multikey: the asked label's number is the needle; multivalue: "
                        "the label's numbers)")
    p.add_argument("--num_keys", type=int, default=4, help="key sentences of a multikey prompt (as eval_needles.py)")
    p.add_argument("--prefill_chunk", type=int, default=4096, help="prompt tokens per prefill step; 0 = all at once")
    p.add_argument("--seed", type=int, default=0, help="seeds the needles and haystacks (as eval_needles.py)")
    p.add_argument("--hnsw_keys", action="store_true",
                   help="also rank as 'keys' selection through HNSW does (the model's HNSW settings; --hnsw_m, "
                        "--hnsw_ef_construction, --hnsw_ef_search, --hnsw_keys_per_head change them)")
    p.add_argument("--answer", action="store_true",
                   help="teacher-force the answer and probe the query of every answer token (default: only the last prompt "
                        "token's); with --hnsw_keys each of them builds graphs of its own, so one costs a build per token")
    p.add_argument("--retrieval", choices=("exact", "hnsw"), default="exact",
                   help="how the model retrieves while it prefills the prompt (the probe scores every candidate itself)")
    add_attention_overrides(p)
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.trials < 1 or any(length <= 0 for length in args.lengths) or args.prefill_chunk < 0:
        raise UsageError("--trials and --lengths must be positive, --prefill_chunk >= 0")
    low, high = KEY_RANGE["multikey"]
    if not low <= args.num_keys <= high:
        raise UsageError(f"--num_keys must lie in {low}..{high}, got {args.num_keys}")
    args.lengths = sorted(set(args.lengths))
    return args


def probe_prompt(model, recorders, ids, answer_ids, targets, prefill_chunk, hnsw):
    """Prefill ids, then teacher-force answer_ids (may be empty); targets [(query position, target
    position)] -> ({layer: [({ranking: ranks (g,)} or None, candidates, HNSW build seconds,
    bounds_must_score (g,)) per target]}, teacher_forced's distributions (a, vocab) or None): each
    query ranks the block of its target position (None: that block is in the query's window)."""
    for recorder in recorders.values():
        recorder.keys.clear()
        recorder.queries.clear()
    if answer_ids:
        distributions = teacher_forced(model, ids, answer_ids, prefill_chunk)
    else:
        prefill(model, ids, prefill_chunk)
        distributions = None
    config = model.config
    results = {}
    for layer, recorder in recorders.items():
        keys, queries = recorder.recorded()
        results[layer] = []
        for position, target_position in targets:
            query = queries[0, :, position]
            scores, building = block_scores(query, keys[0], position, config.ann_window, config.ann_block_size,
                                            config.ann_block_summary, hnsw)
            must_score = bounds_must_score(query, keys[0], scores["max_logit"], config.ann_block_size, config.ann_top_n)
            results[layer].append((target_ranks(scores, target_position, config.ann_block_size), scores["summary"].shape[1],
                                   building, must_score))
    return results, distributions


def summary_rows(collected, probabilities, top_n, rankings):
    """Rows per (length, lang, layer), and per answer token label with --answer (the key's fourth item)."""
    rows = []
    for (length, lang, layer, token), entries in collected.items():
        ranks = {ranking: torch.cat([entry[0][ranking] for entry in entries]).float() for ranking in rankings}
        row = {"length": length, "lang": lang, "layer": layer, "trials": len(entries),
               "candidates": round(sum(entry[1] for entry in entries) / len(entries), 1),
               "bounds_must_score": round(float(torch.cat([entry[3] for entry in entries]).mean()), 4)}
        for ranking, values in ranks.items():
            row[f"{ranking}_median_rank"] = float(values.median())
            row[f"{ranking}_in_top_n"] = round(float((values <= top_n).float().mean()), 4)
        if "hnsw_keys" in rankings:
            row["hnsw_build_seconds"] = round(sum(entry[2] for entry in entries) / len(entries), 4)
        if token is not None:
            chances = torch.tensor(probabilities[length, lang, token], dtype=torch.float64)
            row.update(answer_token=token, p_correct=round(float(chances[:, 0].mean()), 4),
                       argmax=round(float(chances[:, 1].mean()), 4))
        rows.append(row)
    return sorted(rows, key=lambda row: (row["length"], row["lang"], row["layer"], label_order(row.get("answer_token"))))


def label_order(label):
    """copy_targets' labels in answer order, each number's `prev` row after its d1: lead, d1, ..., end,
    n2.lead, n2.d1, n2.prev, n2.d2, ... (None: the default probe's one row)."""
    if label is None:
        return (1, 0)
    number, _, token = label.rpartition(".")
    within = {"lead": 0, "prev": 1.5, "end": float("inf")}.get(token)
    return (int(number[1:]) if number else 1, int(token[1:]) if within is None else within)


def print_table(rows, top_n, rankings):
    names = " ".join(f"{ranking + ' rank':>15} {'top ' + str(top_n):>7}" for ranking in rankings)
    per_token = "answer_token" in rows[0] if rows else False
    extra = f" {'token':>7} {'p_correct':>9} {'argmax':>6}" if per_token else ""
    print(f"{'length':>7} {'lang':<4} {'layer':>5}{extra} {'trials':>6} {'blocks':>7} {names} {'must score':>10}")
    for row in rows:
        cells = " ".join(f"{row[ranking + '_median_rank']:>15.1f} {row[ranking + '_in_top_n']:>7.2f}" for ranking in rankings)
        extra = f" {row['answer_token']:>7} {row['p_correct']:>9.3f} {row['argmax']:>6.2f}" if per_token else ""
        print(f"{row['length']:>7} {row['lang']:<4} {row['layer']:>5}{extra} {row['trials']:>6} {row['candidates']:>7.1f} "
              f"{cells} {row['bounds_must_score']:>10.2f}")


def repeated_numbers(labels, numbers, prompt_ids, answer_ids):
    """[(k, answer index of number k's first digit, the first digit token of number k-1 in the prompt)]
    for each later number k >= 2 of the answer whose first digit differs from the one before it:
    where the query that should move on to number k could instead repeat number k-1."""
    repeats = []
    for number in range(2, len(numbers) + 1):
        index = labels.index(f"n{number}.d1")
        previous = prompt_ids[numbers[number - 2]]
        if previous != answer_ids[index]:
            repeats.append((number, index, previous))
    return repeats


def main(argv=None):
    transformers_logging.disable_progress_bar()
    try:
        args = parse_args(argv)
        apply_run_arguments(args)
        corpus = read_corpus(args.data_dir)
        path = resolve_load_path(args.load)
        model, tokenizer = load_model(path, None, args.retrieval, torch.device(args.device), attention_overrides(args))
        if model.config.attn_impl != "ann":
            raise UsageError(f"{path} is a {model.config.attn_impl} model: only ANN attention selects blocks")
        least = min(shortest_prompt(tokenizer, args.task, lang) for lang in args.langs)
        if args.lengths[0] < least:
            raise UsageError(f"--lengths {args.lengths[0]} is shorter than the {args.task} template ({least} tokens)")
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    recorders = record_layers(model)
    streams = {lang: heldout_stream(corpus, lang, tokenizer) for lang in args.langs}
    hnsw = model.config if args.hnsw_keys else None
    collected, probabilities, skipped = {}, {}, 0
    for length in args.lengths:
        for lang in args.langs:
            for index, depth in enumerate(spread_depths(args.trials)):
                rng = trial_rng(args.seed, args.task, lang, length, index)
                needles = draw_needles(rng, args.task, lang, depth, num_keys=args.num_keys if args.task == "multikey" else None)
                stream = streams[lang]
                ids, _ = build_prompt(tokenizer, stream, needles, length, rng.randrange(stream.rotate))
                numbers = [value_position(tokenizer, ids, value) for value in needles.values]
                if None in numbers:
                    raise RuntimeError(f"the {lang} prompt of {length} tokens does not spell {needles.values}")
                if args.answer:
                    answer_ids = tokenizer(answer(needles), add_special_tokens=False).input_ids
                    labels, copied = zip(*copy_targets(tokenizer, answer_ids, numbers))
                    targets = list(enumerate(copied, start=len(ids) - 1))
                    repeats = repeated_numbers(labels, numbers, ids, answer_ids)
                    labels += tuple(f"n{number}.prev" for number, _, _ in repeats)
                    targets += [(len(ids) - 1 + index, numbers[number - 2]) for number, index, _ in repeats]
                else:
                    answer_ids, labels, targets, repeats = [], [None], [(len(ids) - 1, numbers[0])], []
                results, distributions = probe_prompt(model, recorders, ids, answer_ids, targets, args.prefill_chunk, hnsw)
                if distributions is not None:
                    chances = token_chances(distributions, answer_ids)
                    print(f"{lang} {length} depth {depth:.2f} {needles.values[0]}: p_correct per answer token "
                          + " ".join(f"{value:.2f}" for value in chances[0].tolist()))
                    if repeats:
                        repeated = token_chances(distributions[[index for _, index, _ in repeats]],
                                                 [token for _, _, token in repeats])
                        chances = tuple(torch.cat(pair) for pair in zip(chances, repeated))
                    for label, outcome in zip(labels, zip(*(part.tolist() for part in chances))):
                        probabilities.setdefault((length, lang, label), []).append(outcome)
                for layer, entries in results.items():
                    if distributions is not None:
                        print(f"  layer {layer}: best-key rank of the copied block per answer token (kv heads) "
                              + " ".join("-" if entry[0] is None else "/".join(map(str, entry[0]["max_logit"].tolist()))
                                         for entry in entries[: len(answer_ids)]))
                    for label, entry in zip(labels, entries):
                        if entry[0] is None or entry[3] is None:
                            skipped += 1
                            continue
                        collected.setdefault((length, lang, layer, label), []).append(entry)
    top_n = model.config.ann_top_n
    rankings = RANKINGS + (("hnsw_keys",) if args.hnsw_keys else ())
    rows = summary_rows(collected, probabilities, top_n, rankings)
    asked = ("each answer token's query ranks the block holding the prompt token it copies" if args.answer
             else "the last query's rank of the needle's block")
    print(f"model: {path}; {asked} (blocks of {model.config.ann_block_size} tokens) among its candidates, per kv head; "
          f"top {top_n} is what it retrieves")
    print_table(rows, top_n, rankings)
    if any(str(row.get("answer_token")).endswith(".prev") for row in rows):
        print("n<k>.prev: the query of number k's first digit ranks the block of number k-1; its p_correct and argmax "
              "are those of repeating number k-1's first digit")
    if skipped:
        print(f"{skipped} (query, layer) pairs had the needle in the window or at most top_n candidates "
              "and are left out")
    if args.json:
        run_config = {"load": str(path), "task": args.task, "num_keys": args.num_keys, "lengths": args.lengths,
                      "langs": args.langs, "trials": args.trials,
                      "seed": args.seed, "top_n": top_n, "block_size": model.config.ann_block_size,
                      "window": model.config.ann_window, "summary": model.config.ann_block_summary,
                      "retrieval": args.retrieval, "hnsw_keys": args.hnsw_keys, "answer": args.answer,
                      **{name: getattr(model.config, name)
                         for name in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search", "hnsw_keys_per_head")}}
        write_results(args.json, {"config": run_config, "rows": rows}, plot_selection, f"needle block selection: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
