"""Does a model copy what it read before, from near and from far? Loss on held-out prose passages
read once and then again and again.

    python scripts/probe_repeats.py --load out/prose_ann/model
    python scripts/probe_repeats.py --load out/prose_ann/model --passage_tokens 8 64 256 --length 1024

For each --passage_tokens P, --passages held-out passages of P tokens (dataset/prose.py's split of
the texts in --data_dir, every language the corpus has) are each repeated to --length tokens and
scored in one pass (evaluation/copying.py repeated_passage_losses): the mean NLL of the first
reading's tokens and of the repeated readings'. Every repeated token has its copy exactly P tokens
back: with P below the ANN window the copy is in the window, beyond it only retrieved blocks hold it.
A model that copies brings the repeated NLL near 0; "gain" is first minus repeated.
--json PATH writes {"config", "rows"} (rows: lang, passage_tokens, copy_from, first_nll, repeated_nll,
passages, length) and PATH with .png.
Exit codes: 0 done, 2 bad arguments, a missing text file or nothing loadable.
"""

import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from dataset.prose import DEFAULT_DATA_DIR, corpus_languages, language_texts, read_corpus
from evaluation.copying import repeated_passage_losses
from evaluation.loading import add_run_arguments, apply_run_arguments, load_model, resolve_load_path
from evaluation.reports import plot_repeats, write_results
from model.config import RETRIEVERS


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="model folder, out dir or checkpoint .pt")
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder with kjv.txt, tinyshakespeare.txt, sanguo.txt")
    p.add_argument("--passage_tokens", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--length", type=int, default=512, help="tokens of each scored document")
    p.add_argument("--passages", type=int, default=8, help="passages per language and passage length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retrieval", choices=RETRIEVERS, default="exact")
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.passages < 1 or any(tokens < 2 for tokens in args.passage_tokens):
        raise UsageError("--passages must be >= 1 and every --passage_tokens >= 2")
    too_long = [tokens for tokens in args.passage_tokens if 2 * tokens > args.length]
    if too_long:
        raise UsageError(f"--length {args.length} does not hold two readings of --passage_tokens {too_long[0]}")
    return args


def heldout_passages(tokens, count, size, rng):
    """`count` passages of `size` consecutive tokens from random places of `tokens`."""
    if len(tokens) < size:
        raise UsageError(f"the held-out text has {len(tokens)} tokens, fewer than --passage_tokens {size}")
    return [tokens[start : start + size] for start in (rng.randrange(len(tokens) - size + 1) for _ in range(count))]


def main(argv=None):
    transformers_logging.disable_progress_bar()
    try:
        args = parse_args(argv)
        apply_run_arguments(args)
        corpus = read_corpus(args.data_dir)
        model, tokenizer = load_model(resolve_load_path(args.load), None, args.retrieval, torch.device(args.device))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    window = model.config.ann_window if model.config.attn_impl == "ann" else None
    print(f"model: {args.load}, {model.config.attn_impl} attention" + (f", window {window}" if window else "")
          + f", documents of {args.length} tokens")
    print(f"{'lang':<5} {'passage':>8} {'copy':>8} {'first NLL':>10} {'repeated NLL':>13} {'gain':>6}")
    rows = []
    for lang in corpus_languages(corpus):
        tokens = tokenizer("".join(language_texts(corpus, lang)[1]), add_special_tokens=False).input_ids
        for size in args.passage_tokens:
            rng = random.Random(f"{args.seed}/{lang}/{size}")
            try:
                passages = heldout_passages(tokens, args.passages, size, rng)
            except UsageError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
            first, repeated = repeated_passage_losses(model, passages, args.length)
            where = "window" if window and size <= window else ("far" if window else "-")
            rows.append({"lang": lang, "passage_tokens": size, "copy_from": where, "first_nll": round(first, 4),
                         "repeated_nll": round(repeated, 4), "passages": args.passages, "length": args.length})
            print(f"{lang:<5} {size:>8} {where:>8} {first:>10.3f} {repeated:>13.3f} {first - repeated:>6.2f}", flush=True)
    if args.json:
        write_results(args.json, {"config": vars(args), "rows": rows}, plot_repeats, f"repeated held-out passages: {args.load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
