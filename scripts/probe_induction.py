"""Can this model, with these settings, learn to copy? Train a fresh one on repeated random tokens.

    python scripts/probe_induction.py --attn dense --lr 1e-3 --steps 300
    python scripts/probe_induction.py --attn ann --key_shift 1 --min_span 20 --max_span 64 --steps 500

A fresh model (the trainer's architecture, sizes from the flags) learns sequences of --length
tokens that are one span of random ids repeated (evaluation/induction.py): the first reading is
noise, every later token has its copy one span back. The table is the NLL of the first reading and
of the repeated readings on fresh batches as training goes: the repeated NLL falling far below the
first is the induction mechanism forming; its step is when. Spans drawn from --min_span..--max_span
per batch (equal: a fixed distance, which a positional head can copy without matching content);
spans longer than --ann_window copy through retrieved blocks only.
--json PATH writes {"config", "rows"} (rows: step, loss, first_nll, repeated_nll) and PATH with .png;
--save DIR saves the trained model (a folder trainer/train_pretrain.py --from_weight continues from).
--hold_wide_shift keeps a --key_shift 2 / --query_shift model's wide shift at zero, so it copies with the
one-token match here and a later stage (the trainer's --wide_shift_from_step) adds the two-token one.
Exit codes: 0 done, 2 bad arguments.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from common.cli import OneLineParser, UsageError
from evaluation.induction import train_induction
from evaluation.loading import add_run_arguments, apply_run_arguments
from evaluation.reports import plot_induction, write_results
from model.config import BLOCK_SUMMARIES, MiniMindConfig
from model.model import MiniMindForCausalLM
from trainer.optim import wide_shift_parameters


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", choices=("dense", "ann"), default="ann")
    p.add_argument("--block_position", choices=("capped", "true"), default="capped")
    p.add_argument("--block_summary", choices=BLOCK_SUMMARIES, default="bounds", help="how blocks are scored for retrieval")
    p.add_argument("--ann_window", type=int, default=16)
    p.add_argument("--ann_top_n", type=int, default=4)
    p.add_argument("--key_shift", type=int, default=0)
    p.add_argument("--query_shift", type=int, default=0)
    p.add_argument("--hold_wide_shift", action="store_true",
                   help="keep the token-shift weights beyond the key's first previous token at zero (as the "
                        "trainer's --wide_shift_from_step does), so a --key_shift 2 model trains as --key_shift 1")
    p.add_argument("--vocab", type=int, default=6400)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8, help="query heads (2 KV heads)")
    p.add_argument("--rope_theta", type=float, default=1e4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--min_span", type=int, default=32)
    p.add_argument("--max_span", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--save", default=None, help="save the trained model folder here")
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.log_every < 1:
        raise UsageError("--steps, --batch and --log_every must be >= 1")
    if not 2 <= args.min_span <= args.max_span or 2 * args.max_span > args.length:
        raise UsageError(f"need 2 <= --min_span <= --max_span and two readings of --max_span {args.max_span} "
                         f"within --length {args.length}")
    if args.hold_wide_shift and args.key_shift < 2 and not args.query_shift:
        raise UsageError("--hold_wide_shift holds a token shift the model does not have: "
                         "it needs --key_shift 2 or --query_shift >= 1")
    return args


def main(argv=None):
    try:
        args = parse_args(argv)
        apply_run_arguments(args)
        config = MiniMindConfig(vocab_size=args.vocab, hidden_size=args.hidden_size,
                                num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.heads,
                                num_key_value_heads=2, rope_theta=args.rope_theta, attn_impl=args.attn,
                                ann_window=args.ann_window, ann_top_n=args.ann_top_n,
                                ann_block_position=args.block_position, ann_block_summary=args.block_summary,
                                key_shift=args.key_shift,
                                query_shift=args.query_shift)
    except (UsageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = MiniMindForCausalLM(config).to(args.device)
    attention = "dense" if args.attn == "dense" else f"ann ({args.block_position} positions, window {args.ann_window})"
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {attention}, "
          f"spans {args.min_span}-{args.max_span} of {args.vocab} ids, lr {args.lr}")
    print(f"{'step':>6} {'loss':>7} {'first NLL':>10} {'repeated NLL':>13}")
    rows = train_induction(model, args.steps, args.lr, args.batch, args.length, args.min_span, args.max_span,
                           args.seed, args.log_every, on_row=lambda row: print(
                               f"{row['step']:>6} {row['loss']:>7.3f} {row['first_nll']:>10.3f} "
                               f"{row['repeated_nll']:>13.3f}", flush=True),
                           held=wide_shift_parameters(model) if args.hold_wide_shift else ())
    if args.save:
        model.save_pretrained(args.save)
        print(f"saved the model to {args.save}")
    if args.json:
        write_results(args.json, {"config": vars(args), "rows": rows}, plot_induction,
                      f"induction on random tokens: {attention}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
