"""Which part of passkey copying a model has learned: the loss on each answer digit, by kind and distance.

    python scripts/probe_copying.py --load out/long_ann/model
    python scripts/probe_copying.py --load out/long_ann/checkpoints/step_0000900.pt --docs 200
    python scripts/probe_copying.py --load out/long_ann/model --split 64   # compare models of other windows

Scores held-out text in the training format (scripts/make_sample_data.py, its own seed: drills and
passkey documents that ask once) and splits every answer "What is the pass key? The pass key is
71432." two ways:
  - first digit (` 7`, the token after "key is": the only space-prefixed digit) vs the four later
    ones (`1`, `4`, `3`, `2`: the token after a digit), and the later ones again by whether the
    digit before them occurs once in the key or more (in 22429, "the digit after 2" is ambiguous
    to a copy that matches one token, so those digits need the token before it too);
  - whether the key's last mention before the answer is within the ANN window or beyond it (then
    only retrieved blocks hold it); `--split N` splits at N tokens instead.
Chance is ln 10 = 2.30 nats. A passkey model needs all four numbers near 0; the runs in
docs/LONG_CONTEXT.md learned them in different orders, and this tells which one a checkpoint lacks.
"""

import argparse
import math
import random
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from transformers.utils import logging as transformers_logging

from scripts.eval_chat import OneLineParser, UsageError, load_model, resolve_load_path
from scripts.make_sample_data import PASSKEY_QUESTION, make_passkey_training

ANSWER = re.compile(re.escape(PASSKEY_QUESTION) + r" (\d{5})\.")
KEY_DIGITS = 5


def answer_spans(text):
    """text -> [(answer's first char, char of the key's previous mention)] for every answer."""
    spans = []
    for match in ANSWER.finditer(text):
        start, key = match.start(1), match.group(1)
        spans.append((start, text.rfind(key, 0, start)))
    return spans


def after_repeated_digit(key):
    """'22429' -> [True, True, False, True]: for each later digit, whether the digit before it occurs
    more than once in the key."""
    return [key.count(previous) > 1 for previous in key[:-1]]


def digit_losses(model, tokenizer, text, window):
    """One text -> [(beyond_window, first digit NLL, [later digit NLLs], key)] for its answers whose
    digits are single tokens (the shipped tokenizer writes ` 71432` as ` 7` `1` `4` `3` `2`)."""
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    token_at = {}
    for index, (begin, end) in enumerate(offsets):
        for char in range(begin, end):
            token_at.setdefault(char, index)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    nll = F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="none")
    results = []
    for start, mention in answer_spans(text):
        first, previous = token_at[start], token_at[mention]
        digits = ids[first : first + KEY_DIGITS]
        if tokenizer.decode(digits).strip() != text[start : start + KEY_DIGITS]:
            continue
        losses = nll[first - 1 : first - 1 + KEY_DIGITS].tolist()
        results.append((first - previous > window, losses[0], losses[1:], text[start : start + KEY_DIGITS]))
    return results


def probe(model, tokenizer, num_docs, seed, split=None):
    """-> {(beyond split, "first" | "later" | "after unique" | "after repeated"): (mean NLL, count)}
    over num_docs held-out documents; split: tokens between mention and answer that count as
    beyond (default: the model's window)."""
    window = split or model.config.ann_window
    sums = {}
    for record in make_passkey_training(random.Random(f"probe:{seed}"), num_docs, max_questions=1):
        for beyond, first, later, key in digit_losses(model, tokenizer, record["text"], window):
            repeated = after_repeated_digit(key)
            parts = (("first", [first]), ("later", later),
                     ("after unique", [loss for loss, ambiguous in zip(later, repeated) if not ambiguous]),
                     ("after repeated", [loss for loss, ambiguous in zip(later, repeated) if ambiguous]))
            for part, values in parts:
                total, count = sums.get((beyond, part), (0.0, 0))
                sums[(beyond, part)] = (total + sum(values), count + len(values))
    return {key: (total / count, count) for key, (total, count) in sums.items()}


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="model folder, out dir or checkpoint .pt")
    p.add_argument("--docs", type=int, default=200, help="held-out documents to score (~40%% drills)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", type=int, default=0,
                   help="tokens back from which a key mention counts as far (0: the model's window)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


def main(argv=None):
    transformers_logging.disable_progress_bar()
    try:
        args = parse_args(argv)
        if args.docs < 1:
            raise UsageError(f"--docs must be >= 1, got {args.docs}")
        if args.split < 0:
            raise UsageError(f"--split must be >= 0 (0: the model's window), got {args.split}")
        if args.threads:
            torch.set_num_threads(args.threads)
        model, tokenizer = load_model(resolve_load_path(args.load), None, None, torch.device("cpu"))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    split = args.split or model.config.ann_window
    table = probe(model, tokenizer, args.docs, args.seed, split)
    print(f"answer digit NLL (nats; chance {math.log(10):.2f}), window {model.config.ann_window} tokens, "
          f"split at {split} tokens back")
    print(f"{'key mention':<14} {'first digit':>12} {'later digits':>13} {'after unique':>13} "
          f"{'after repeated':>15} {'answers':>8}")
    for beyond, name in ((False, f"<= {split} back"), (True, f"> {split} back")):
        first, count = table.get((beyond, "first"), (math.nan, 0))
        later, unique, repeated = (table.get((beyond, part), (math.nan, 0))[0]
                                   for part in ("later", "after unique", "after repeated"))
        print(f"{name:<14} {first:>12.2f} {later:>13.2f} {unique:>13.2f} {repeated:>15.2f} {count:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
