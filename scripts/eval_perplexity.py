"""Held-out loss by how much context a token has: does retrieval make far context useful on real text?

    python scripts/eval_perplexity.py --load out/prose_ann --dense out/prose_dense --threads 2 \\
        --json out/perplexity.json
    python scripts/eval_perplexity.py --load out/prose_ann --texts dataset/prose/prose_heldout_sanguo.txt
    python scripts/eval_perplexity.py --load none --dense out/prose_dense     # the dense model alone

Each held-out text (default dataset/prose/prose_heldout_*.txt, written by scripts/make_prose_data.py;
never trained on) is read as one document, cut to --max_tokens, and scored token by token through
the KV cache, --chunk tokens at a time. The loss of the token at position p (p tokens before it) is
counted in its position bucket: 0-512, 512-4k, 4k-16k, 16k-64k, 64k+. Variants:
    retrieval    the --load ANN model as saved (window plus top_n retrieved blocks)
    window_only  the same weights with top_n 0: the window alone, nothing retrieved
    recent_context  (with --recent_context N) the same model, each --chunk piece read with only the
                 N tokens before it: where it matches retrieval, the text further back was not used
    dense        the --dense model, only up to --dense_max_tokens (within and a little past its
                 trained length: its positions beyond are untrained, and its cost is quadratic)
A lower loss with retrieval than window_only shows that retrieved blocks help; a lower loss with
retrieval than recent_context, on buckets beyond N, that the text more than N tokens back does.
--json PATH writes {"config", "rows"} (rows: model, seed (its training seed), variant, text, bucket,
loss, tokens; text "all"
sums every text) and PATH with .png: loss by position bucket per variant.
Exit codes: 0 done, 2 bad arguments or nothing loadable.
"""

import glob
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from common.cpu_memory import retain_freed_memory
from evaluation.loading import (add_attention_overrides, add_run_arguments, apply_run_arguments, attention_overrides,
                                load_model, resolve_load_path, training_seed)
from evaluation.reports import plot_losses, write_results

BUCKET_EDGES = (0, 512, 4096, 16384, 65536)
DEFAULT_TEXTS = "dataset/prose/prose_heldout_*.txt"


def bucket_name(index):
    low = BUCKET_EDGES[index]
    if index + 1 == len(BUCKET_EDGES):
        return f"{low // 1024}k+"
    high = BUCKET_EDGES[index + 1]
    return f"{low if low < 1024 else f'{low // 1024}k'}-{high if high < 1024 else f'{high // 1024}k'}"


BUCKETS = [bucket_name(index) for index in range(len(BUCKET_EDGES))]


def bucket_of(positions):
    """positions (n,) long -> bucket index (n,) long: the bucket of a token with that many tokens before it."""
    return torch.bucketize(positions, torch.tensor(BUCKET_EDGES[1:]), right=True)


@torch.no_grad()
def token_losses(model, ids, chunk):
    """ids: list of n token ids -> (n - 1,) float64 losses of predicting ids[p] from ids[:p] for
    p >= 1, filled through the KV cache `chunk` tokens at a time."""
    tokens = torch.tensor([ids], device=model.device)
    cache = model.new_cache(reserve=len(ids))
    losses, previous_logits = [], None  # the last logits of the previous chunk predict this chunk's first token
    for start in range(0, len(ids), chunk):
        piece = tokens[:, start:start + chunk]
        logits = model(input_ids=piece, cache=cache, use_cache=True).logits[0].float()
        predictors = logits[:-1] if previous_logits is None else torch.cat([previous_logits, logits[:-1]])
        targets = piece[0, 1:] if previous_logits is None else piece[0]
        losses.append(F.cross_entropy(predictors, targets, reduction="none").double().cpu())
        previous_logits = logits[-1:]
    return torch.cat(losses)


def bucket_sums(losses, positions):
    """losses, positions: (m,) -> (loss sums per bucket, token counts per bucket), lists of len(BUCKETS)."""
    buckets = bucket_of(positions)
    sums = torch.zeros(len(BUCKETS), dtype=torch.float64).index_add_(0, buckets, losses)
    counts = torch.zeros(len(BUCKETS), dtype=torch.long).index_add_(0, buckets, torch.ones_like(buckets))
    return sums.tolist(), counts.tolist()


def position_losses(model, ids, chunk):
    """ids: list of n token ids -> (loss sums per bucket, token counts per bucket): every token
    predicted from everything before it."""
    return bucket_sums(token_losses(model, ids, chunk), torch.arange(1, len(ids)))


def recent_context_losses(model, ids, context, chunk):
    """Like position_losses, but the tokens of each `chunk`-token piece are predicted from the
    `context` tokens before the piece only (and the piece's earlier tokens): a token at position p
    sees between `context` and `context + chunk` tokens, never the text before. Positions stay the
    true ones, so the buckets compare with position_losses: where the two agree, the text further
    back was of no use."""
    sums, counts = [0.0] * len(BUCKETS), [0] * len(BUCKETS)
    for start in range(1, len(ids), chunk):
        low = max(0, start - context)
        piece = ids[low:start + chunk]
        losses = token_losses(model, piece, chunk)[start - low - 1:]
        piece_sums, piece_counts = bucket_sums(losses, torch.arange(start, start + len(losses)))
        sums = [a + b for a, b in zip(sums, piece_sums)]
        counts = [a + b for a, b in zip(counts, piece_counts)]
    return sums, counts


def window_only(model):
    """The same model with nothing retrieved: top_n 0 in its config and in every ANN layer."""
    model.config.ann_top_n = 0
    for layer in model.model.layers:
        layer.self_attn.core.top_n = 0
    return model


def rows_for(name, seed, variant, per_text):
    """per_text: {text: (sums, counts)} -> rows per text and bucket, and rows summed over texts ("all"),
    for the model `name` trained with `seed`."""
    rows = []
    totals = ([0.0] * len(BUCKETS), [0] * len(BUCKETS))
    for text, (sums, counts) in per_text.items():
        for index, bucket in enumerate(BUCKETS):
            totals[0][index] += sums[index]
            totals[1][index] += counts[index]
            if counts[index]:
                rows.append({"model": name, "seed": seed, "variant": variant, "text": text, "bucket": bucket,
                             "loss": round(sums[index] / counts[index], 5), "tokens": counts[index]})
    for index, bucket in enumerate(BUCKETS):
        if totals[1][index]:
            rows.append({"model": name, "seed": seed, "variant": variant, "text": "all", "bucket": bucket,
                         "loss": round(totals[0][index] / totals[1][index], 5), "tokens": totals[1][index]})
    return rows


def print_table(rows):
    texts = list(dict.fromkeys(row["text"] for row in rows))
    print(f"\n{'variant':<12} {'text':<28} " + " ".join(f"{bucket:>14}" for bucket in BUCKETS))
    for variant in dict.fromkeys(row["variant"] for row in rows):
        for text in texts:
            cells = {row["bucket"]: row for row in rows if row["variant"] == variant and row["text"] == text}
            if cells:
                print(f"{variant:<12} {text[:28]:<28} " + " ".join(
                    f"{cells[b]['loss']:>6.3f} ({cells[b]['tokens']:>5})" if b in cells else f"{'':>14}" for b in BUCKETS))


def parse_args(argv=None):
    p = OneLineParser(description="MiniMind held-out loss by context position")
    p.add_argument("--load", default="out/prose_ann/model",
                   help="the ANN model: folder, out dir or checkpoint .pt; none: only the --dense model")
    p.add_argument("--dense", default=None, help="a dense model to compare, scored up to --dense_max_tokens")
    p.add_argument("--texts", nargs="+", default=None, help=f"held-out text files (default {DEFAULT_TEXTS})")
    p.add_argument("--max_tokens", type=int, default=131072, help="tokens scored per text (its start)")
    p.add_argument("--dense_max_tokens", type=int, default=2048, help="tokens scored per text with the dense model")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per forward through the cache")
    p.add_argument("--recent_context", type=int, default=0,
                   help="also score the ANN model with only this many tokens before each --chunk piece "
                        "(variant recent_context; 0: not scored)")
    add_attention_overrides(p)
    add_run_arguments(p)
    return p.parse_args(argv)


def validate_args(args):
    args.texts = args.texts or sorted(glob.glob(DEFAULT_TEXTS))
    if not args.texts:
        raise UsageError(f"no held-out texts: none match {DEFAULT_TEXTS} (scripts/make_prose_data.py writes them) "
                         "and --texts is not given")
    missing = [path for path in args.texts if not Path(path).is_file()]
    if missing:
        raise UsageError(f"--texts {missing[0]}: file not found")
    if args.load == "none" and not args.dense:
        raise UsageError("--load none scores only the --dense model, and --dense is not given")
    for name in ("max_tokens", "dense_max_tokens", "chunk"):
        if getattr(args, name) < 2:
            raise UsageError(f"--{name} must be >= 2, got {getattr(args, name)}")
    if args.recent_context < 0:
        raise UsageError(f"--recent_context must be >= 0, got {args.recent_context}")


def score_texts(tokenizer, texts, max_tokens, losses_of):
    """{text name: losses_of(ids)} for every held-out file, each cut to its first max_tokens tokens."""
    scored = {}
    for path in texts:
        ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False, verbose=False).input_ids
        scored[Path(path).stem] = losses_of(ids[:max_tokens])
    return scored


def ann_rows(model, tokenizer, path, args):
    """The ANN model's rows (retrieval, recent_context when asked, window_only) and its selection settings."""
    print(f"model: {path} (window {model.config.ann_window}, top {model.config.ann_top_n}, "
          f"{model.config.ann_block_summary} summaries)")
    seed = training_seed(path)
    selection = {"ann_top_n": model.config.ann_top_n, "ann_block_summary": model.config.ann_block_summary,
                 "ann_retrieval_layers": model.config.ann_retrieval_layers, "ann_logn_length": model.config.ann_logn_length,
                 "ann_batch_distractors": model.config.ann_batch_distractors}
    rows = rows_for(str(path), seed, "retrieval", score_texts(
        tokenizer, args.texts, args.max_tokens, lambda ids: position_losses(model, ids, args.chunk)))
    if args.recent_context:
        rows += rows_for(str(path), seed, "recent_context", score_texts(
            tokenizer, args.texts, args.max_tokens,
            lambda ids: recent_context_losses(model, ids, args.recent_context, args.chunk)))
    rows += rows_for(str(path), seed, "window_only", score_texts(
        tokenizer, args.texts, args.max_tokens, lambda ids: position_losses(window_only(model), ids, args.chunk)))
    return rows, selection


def main(argv=None):
    transformers_logging.disable_progress_bar()
    retain_freed_memory()
    try:
        args = parse_args(argv)
        validate_args(args)
        apply_run_arguments(args)
        device = torch.device(args.device)
        path = None if args.load == "none" else resolve_load_path(args.load)
        model = tokenizer = None
        if path is not None:
            model, tokenizer = load_model(path, None, None, device, attention_overrides(args))
            if model.config.attn_impl != "ann":
                raise UsageError(f"--load {path}: a dense model; pass the ANN model to --load and this one to --dense")
        dense_path = resolve_load_path(args.dense) if args.dense else None
        dense, dense_tokenizer = load_model(dense_path, "dense", None, device) if dense_path else (None, None)
        tokenizer = tokenizer or dense_tokenizer
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    print(f"{torch.get_num_threads()} threads, texts: {', '.join(args.texts)}")
    rows, selection = [], {}
    if model is not None:
        rows, selection = ann_rows(model, tokenizer, path, args)
    if dense is not None:
        rows += rows_for(str(dense_path), training_seed(dense_path), "dense", score_texts(
            tokenizer, args.texts, args.dense_max_tokens, lambda ids: position_losses(dense, ids, args.chunk)))
    print_table(rows)
    if args.json:
        run_config = {"load": str(path) if path else None, "dense": str(dense_path) if dense_path else None, "texts": args.texts,
                      "max_tokens": args.max_tokens, "dense_max_tokens": args.dense_max_tokens, "chunk": args.chunk,
                      "recent_context": args.recent_context, **selection, "buckets": BUCKETS, "threads": torch.get_num_threads(), "device": args.device}
        write_results(args.json, {"config": run_config, "rows": rows}, plot_losses, f"held-out loss by position: {path or dense_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
