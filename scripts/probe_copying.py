"""Which part of passkey copying a model has learned: the loss on each answer digit, by kind and distance.

    python scripts/probe_copying.py --load out/long_ann/model
    python scripts/probe_copying.py --load out/long_ann/checkpoints/step_0000900.pt --docs 200
    python scripts/probe_copying.py --load out/long_ann/model --split 64   # compare models of other windows

Scores held-out text in the training format (evaluation/passkey.py, its own seed: drills and
passkey documents that ask once) and splits every answer by digit (the first vs the later ones,
and those again by whether the digit before them is repeated in the key) and by distance (the
key's last mention within the ANN window or beyond it; `--split N` splits at N tokens instead):
evaluation/copying.py says how.
Chance is ln 10 = 2.30 nats. A passkey model needs all four numbers near 0; the runs in
docs/LONG_CONTEXT_EXPERIMENTS.md learned them in different orders, and this tells which one a checkpoint lacks.
"""

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from evaluation.copying import probe
from evaluation.loading import load_model, resolve_load_path


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
