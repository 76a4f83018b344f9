"""Does the model's block selection find the needle? Where the block holding a needle's number ranks
among the blocks the answering query could retrieve, in every layer.

    python scripts/probe_selection.py --load out/prose_ann/model --lengths 400 1024 4096 --trials 8
    python scripts/probe_selection.py --load out/prose_ann/model --lengths 16384 --langs zh --json out/selection.json

The prompts are scripts/eval_needles.py's `single` prompts (the same --seed gives the same needles
and haystacks). Each is prefilled once; the query of its last token, which predicts the answer's
first digit, ranks the block holding the number's first token among its candidate blocks three ways
(evaluation/selection.py): by the summary score that selection uses, by the sum over a GQA group's
heads of the largest q . k in the block (a perfectly tight summary), and by the attention mass the
group would give the block if every candidate were visible; with --hnsw_keys also as "keys"
selection through HNSW does: per kv head a graph over the candidate keys, each query head's
hnsw_keys_per_head best keys, the blocks holding them scored by their best keys, the others
never offered (evaluation/selection.py hnsw_key_scores). The model prefills with --retrieval
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
from evaluation.needles import build_prompt, draw_needles, shortest_prompt
from evaluation.reports import plot_selection, write_results
from evaluation.selection import (RANKINGS, block_scores, bounds_must_score, prefill, record_layers, target_ranks,
                                  value_position)
from evaluation.trials import spread_depths, trial_rng


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="ANN model folder, out dir or checkpoint .pt")
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder with kjv.txt, tinyshakespeare.txt, sanguo.txt")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt lengths in tokens")
    p.add_argument("--langs", nargs="+", choices=LANGS, default=list(LANGS))
    p.add_argument("--trials", type=int, default=8, help="prompts per language and length, depths spread over 0..1")
    p.add_argument("--prefill_chunk", type=int, default=4096, help="prompt tokens per prefill step; 0 = all at once")
    p.add_argument("--seed", type=int, default=0, help="seeds the needles and haystacks (as eval_needles.py)")
    p.add_argument("--hnsw_keys", action="store_true",
                   help="also rank as 'keys' selection through HNSW does (the model's HNSW settings; --hnsw_m, "
                        "--hnsw_ef_construction, --hnsw_ef_search, --hnsw_keys_per_head change them)")
    p.add_argument("--retrieval", choices=("exact", "hnsw"), default="exact",
                   help="how the model retrieves while it prefills the prompt (the probe scores every candidate itself)")
    add_attention_overrides(p)
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.trials < 1 or any(length <= 0 for length in args.lengths) or args.prefill_chunk < 0:
        raise UsageError("--trials and --lengths must be positive, --prefill_chunk >= 0")
    args.lengths = sorted(set(args.lengths))
    return args


def probe_prompt(model, recorders, ids, target_position, prefill_chunk, hnsw):
    """{layer: ({ranking: ranks (g,)} or None, candidates, HNSW build seconds, bounds_must_score (g,))}
    of the prompt's last query for the block of target_position (None: that block is in the query's
    window)."""
    for recorder in recorders.values():
        recorder.keys.clear()
        recorder.queries.clear()
    prefill(model, ids, prefill_chunk)
    config = model.config
    position = len(ids) - 1
    results = {}
    for layer, recorder in recorders.items():
        keys, queries = recorder.recorded()
        query = queries[0, :, position]
        scores, building = block_scores(query, keys[0], position, config.ann_window, config.ann_block_size,
                                        config.ann_block_summary, hnsw)
        must_score = bounds_must_score(query, keys[0], scores["max_logit"], config.ann_block_size, config.ann_top_n)
        results[layer] = (target_ranks(scores, target_position, config.ann_block_size), scores["summary"].shape[1],
                          building, must_score)
    return results


def summary_rows(collected, top_n, rankings):
    rows = []
    for (length, lang, layer), entries in collected.items():
        ranks = {ranking: torch.cat([entry[0][ranking] for entry in entries]).float() for ranking in rankings}
        row = {"length": length, "lang": lang, "layer": layer, "trials": len(entries),
               "candidates": round(sum(entry[1] for entry in entries) / len(entries), 1),
               "bounds_must_score": round(float(torch.cat([entry[3] for entry in entries]).mean()), 4)}
        for ranking, values in ranks.items():
            row[f"{ranking}_median_rank"] = float(values.median())
            row[f"{ranking}_in_top_n"] = round(float((values <= top_n).float().mean()), 4)
        if "hnsw_keys" in rankings:
            row["hnsw_build_seconds"] = round(sum(entry[2] for entry in entries) / len(entries), 4)
        rows.append(row)
    return rows


def print_table(rows, top_n, rankings):
    names = " ".join(f"{ranking + ' rank':>15} {'top ' + str(top_n):>7}" for ranking in rankings)
    print(f"{'length':>7} {'lang':<4} {'layer':>5} {'trials':>6} {'blocks':>7} {names} {'must score':>10}")
    for row in rows:
        cells = " ".join(f"{row[ranking + '_median_rank']:>15.1f} {row[ranking + '_in_top_n']:>7.2f}" for ranking in rankings)
        print(f"{row['length']:>7} {row['lang']:<4} {row['layer']:>5} {row['trials']:>6} {row['candidates']:>7.1f} {cells} "
              f"{row['bounds_must_score']:>10.2f}")


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
        least = min(shortest_prompt(tokenizer, "single", lang) for lang in args.langs)
        if args.lengths[0] < least:
            raise UsageError(f"--lengths {args.lengths[0]} is shorter than the single template ({least} tokens)")
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    recorders = record_layers(model)
    streams = {lang: heldout_stream(corpus, lang, tokenizer) for lang in args.langs}
    collected, skipped = {}, 0
    for length in args.lengths:
        for lang in args.langs:
            for index, depth in enumerate(spread_depths(args.trials)):
                rng = trial_rng(args.seed, "single", lang, length, index)
                needles = draw_needles(rng, "single", lang, depth)
                stream = streams[lang]
                ids, _ = build_prompt(tokenizer, stream, needles, length, rng.randrange(stream.rotate))
                target = value_position(tokenizer, ids, needles.values[0])
                if target is None:
                    raise RuntimeError(f"the {lang} prompt of {length} tokens does not spell {needles.values[0]}")
                hnsw = model.config if args.hnsw_keys else None
                for layer, entry in probe_prompt(model, recorders, ids, target, args.prefill_chunk, hnsw).items():
                    if entry[0] is None or entry[3] is None:
                        skipped += 1
                        continue
                    collected.setdefault((length, lang, layer), []).append(entry)
    top_n = model.config.ann_top_n
    rankings = RANKINGS + (("hnsw_keys",) if args.hnsw_keys else ())
    rows = summary_rows(collected, top_n, rankings)
    print(f"model: {path}; the last query's rank of the needle's block (of {model.config.ann_block_size} tokens) "
          f"among its candidates, per kv head; top {top_n} is what it retrieves")
    print_table(rows, top_n, rankings)
    if skipped:
        print(f"{skipped} (prompt, layer) pairs had the needle in the window or at most top_n candidates "
              "and are left out")
    if args.json:
        run_config = {"load": str(path), "lengths": args.lengths, "langs": args.langs, "trials": args.trials,
                      "seed": args.seed, "top_n": top_n, "block_size": model.config.ann_block_size,
                      "window": model.config.ann_window, "summary": model.config.ann_block_summary,
                      "retrieval": args.retrieval, "hnsw_keys": args.hnsw_keys,
                      **{name: getattr(model.config, name)
                         for name in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search", "hnsw_keys_per_head")}}
        write_results(args.json, {"config": run_config, "rows": rows}, plot_selection, f"needle block selection: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
