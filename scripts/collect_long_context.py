"""Collect the long-context runs of several models (seeds) into the result files the docs cite.

    python scripts/collect_long_context.py --needles out/seed*/prose_*/needles*.json \\
        --perplexity out/seed*/prose_ann/perplexity.json --out_dir docs/long_context

Reads the JSON files of scripts/eval_needles.py and scripts/eval_perplexity.py (or result files
this script wrote before, whose runs are taken as they are: new runs fold into committed files) and writes
OUT_DIR/needles.json ({"sources", "rows", "trials"}: every run's rows, each with its model's
training seed) and OUT_DIR/perplexity.json ({"sources", "rows"}), each with its PNG (needles: a
heatmap cell is the mean over seeds and trials; loss: the mean over seeds, bars from the lowest to
the highest). Prints the tables as markdown: needle accuracy per task, language, retrieval and
selection and length with one column per seed; loss per variant and bucket over every text; and the two loss
comparisons of docs/LONG_CONTEXT.md per seed (retrieval vs dense at 0-512, retrieval vs window
only beyond 4k, retrieval vs recent context beyond 16k).
Exit codes: 0 written, 2 a missing or malformed input file.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cli import OneLineParser, UsageError
from model.config import MiniMindConfig
from evaluation.reports import length_label, loss_spread, plot_losses, plot_needles

NEEDLE_KEYS = ("task", "lang", "length", "retrieval", "seed", "accuracy", "trials")
LOSS_KEYS = ("model", "seed", "variant", "text", "bucket", "loss", "tokens")
FAR_BUCKETS = ("4k-16k", "16k-64k", "64k+")
FARTHEST_BUCKETS = ("16k-64k", "64k+")  # past what recent_context reads (eval_perplexity --recent_context 4096, --chunk 4096)


def read_results(path, row_keys, parts):
    """The JSON object in `path`, checked to hold `parts` and rows with every key in `row_keys`; a
    file this script wrote (with "sources" where a run's file has "config") is checked for those."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path}: not JSON ({error})") from None
    if isinstance(result, dict) and "sources" in result and "config" not in result:
        parts = ["sources" if part == "config" else part for part in parts]
    if not isinstance(result, dict) or any(part not in result for part in parts):
        raise UsageError(f"{path}: expected a JSON object with {', '.join(parts)}")
    for index, row in enumerate(result["rows"]):
        missing = [key for key in row_keys if key not in row]
        if missing:
            raise UsageError(f"{path}: row {index} has no {', '.join(missing)}")
    return result


def labelled(result):
    """Needle rows and trials each with "model" (the folder evaluated) and "selection", how it scored
    blocks: the run's ann_block_summary for an ANN model (a config without one has MiniMindConfig's
    default), None for a dense one. HNSW over keys adds its search settings, which decide what it
    finds ("keys, layers 1; 32 keys per head, efSearch 32"), and a top_n other than the config
    default and log-n scaling are named too ("keys, layers 1, top 2, log-n 512; ..."), so runs that
    differ there are not pooled."""
    config = result["config"]
    default = MiniMindConfig()
    selection = config.get("ann_block_summary", default.ann_block_summary) if config.get("attn") == "ann" else None
    top_n = config.get("ann_top_n", default.ann_top_n)
    settings = f", top {top_n}" if top_n != default.ann_top_n else ""
    if config.get("ann_logn_length"):
        settings += f", log-n {config['ann_logn_length']}"
    search = (f"; {config['hnsw_keys_per_head']} keys per head, efSearch {config['hnsw_ef_search']}"
              if selection == "keys" and "hnsw_keys_per_head" in config else "")
    for part in ("rows", "trials"):
        for row in result[part]:
            row.setdefault("model", config.get("load"))
            row.setdefault("selection", selection if row["retrieval"] else None)
            if row["retrieval"]:
                row["selection"] += settings
            if row["retrieval"] == "hnsw" and search:
                row["selection"] += search
    return result


def collect(paths, row_keys, parts, prepare=lambda result: result):
    """{"sources": [{"path", "config"}], part: rows of every file, in order} for the parts besides
    config; prepare(result) adjusts each file's result first. A file collected before adds its
    sources and rows as they are: new runs fold into a committed result file whose own sources
    need not be at hand."""
    collected = {"sources": [], **{part: [] for part in parts if part != "config"}}
    for path in paths:
        result = read_results(path, row_keys, parts)
        if "sources" in result:
            collected["sources"] += result["sources"]
        else:
            result = prepare(result)
            collected["sources"].append({"path": str(path), "config": result["config"]})
        for part in collected:
            if part != "sources":
                collected[part] += result[part]
    return collected


def needle_table(rows):
    """Markdown: one line per task, language, retrieval, selection and length; accuracy (trials) per
    seed, pooling the trials of every run of a cell (e.g. runs at other depths)."""
    seeds = sorted({row["seed"] for row in rows}, key=str)
    cells = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))  # cell -> seed -> [right answers, trials]
    for row in rows:
        pooled = cells[row["task"], row["lang"], row["retrieval"] or "dense", row["selection"] or "", row["length"]][row["seed"]]
        pooled[0] += row["accuracy"] * row["trials"]
        pooled[1] += row["trials"]
    lines = ["| task | lang | retrieval | selection | length | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
             "|---|---|---|---|---:|" + "---:|" * len(seeds)]
    for (task, lang, retrieval, selection, length), by_seed in sorted(cells.items(), key=lambda item: (item[0][:4], item[0][4])):
        scores = [f"{by_seed[s][0] / by_seed[s][1]:.2f} ({by_seed[s][1]})" if s in by_seed else "" for s in seeds]
        lines.append(f"| {task} | {lang} | {retrieval} | {selection} | {length_label(length)} | " + " | ".join(scores) + " |")
    return "\n".join(lines)


def loss_table(rows):
    """Markdown: the loss over every text ("all") per variant and bucket, mean (lowest-highest) over seeds."""
    spread = {key: value for key, value in loss_spread(rows).items() if key[1] == "all"}
    buckets = list(dict.fromkeys(bucket for _, _, bucket in spread))
    lines = ["| variant | " + " | ".join(buckets) + " |", "|---|" + "---:|" * len(buckets)]
    for variant in dict.fromkeys(variant for variant, _, _ in spread):
        cells = [spread.get((variant, "all", bucket)) for bucket in buckets]
        lines.append(f"| {variant} | " + " | ".join(
            "" if cell is None else f"{cell[0]:.3f}" + (f" ({cell[1]:.3f}-{cell[2]:.3f}, {cell[3]} seeds)" if cell[3] > 1 else "")
            for cell in cells) + " |")
    return "\n".join(lines)


def comparisons(rows):
    """Per seed: retrieval vs dense at 0-512 (relative), retrieval minus window only beyond 4k and
    retrieval minus recent context beyond 16k (token-weighted over those buckets), over every text."""
    by_key = {(row["seed"], row["variant"], row["bucket"]): row for row in rows if row["text"] == "all"}
    dense = {row["bucket"]: row for row in rows if row["variant"] == "dense" and row["text"] == "all"}
    lines = []
    for seed in sorted({row["seed"] for row in rows if row["variant"] == "retrieval"}, key=str):
        near = by_key.get((seed, "retrieval", "0-512"))
        dense_near = by_key.get((seed, "dense", "0-512")) or dense.get("0-512")
        if near and dense_near:
            lines.append(f"seed {seed}: 0-512 loss, retrieval {near['loss']:.4f} vs dense {dense_near['loss']:.4f} "
                         f"(seed {dense_near['seed']}): {100 * (near['loss'] / dense_near['loss'] - 1):+.2f}%")
        for other, buckets, where in (("window_only", FAR_BUCKETS, "beyond 4k"), ("recent_context", FARTHEST_BUCKETS, "beyond 16k")):
            pairs = [(by_key[seed, "retrieval", b], by_key[seed, other, b]) for b in buckets
                     if (seed, "retrieval", b) in by_key and (seed, other, b) in by_key]
            if pairs:
                tokens = sum(full["tokens"] for full, _ in pairs)
                difference = sum((full["loss"] - less["loss"]) * full["tokens"] for full, less in pairs) / tokens
                lines.append(f"seed {seed}: {where} ({tokens} tokens), retrieval minus {other.replace('_', ' ')}: "
                             f"{difference:+.4f} nats/token")
    return "\n".join(lines)


def parse_args(argv=None):
    p = OneLineParser(description="Collect needle and held-out loss results of several runs")
    p.add_argument("--needles", nargs="*", default=[],
                   help="JSON files written by scripts/eval_needles.py, or a needles.json this script wrote")
    p.add_argument("--perplexity", nargs="*", default=[],
                   help="JSON files written by scripts/eval_perplexity.py, or a perplexity.json this script wrote")
    p.add_argument("--out_dir", default="docs/long_context", help="where needles.json and perplexity.json go")
    return p.parse_args(argv)


def main(argv=None):
    try:
        args = parse_args(argv)
        if not args.needles and not args.perplexity:
            raise UsageError("nothing to collect: pass --needles and/or --perplexity files")
        needles = collect(args.needles, NEEDLE_KEYS, ("config", "rows", "trials"), labelled) if args.needles else None
        losses = collect(args.perplexity, LOSS_KEYS, ("config", "rows")) if args.perplexity else None
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, result, draw, title in (
        ("needles", needles, lambda r, path: plot_needles(r["trials"], "needles in held-out prose, every seed", path),
         "needle accuracy"),
        ("perplexity", losses, lambda r, path: plot_losses(r["rows"], "held-out loss by position, mean over seeds", path),
         "held-out loss"),
    ):
        if result is None:
            continue
        json_path = out_dir / f"{name}.json"
        json_path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        draw(result, json_path.with_suffix(".png"))
        print(f"wrote {json_path} and {json_path.with_suffix('.png')} ({title}, {len(result['sources'])} runs)")
    if needles:
        print("\n" + needle_table(needles["rows"]))
    if losses:
        print("\n" + loss_table(losses["rows"]) + "\n\n" + comparisons(losses["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
