"""Ablation: validation loss of a tiny model trained with dense vs ANN attention of several shapes.

Every config trains the same model (MiniMindForCausalLM, the shipped tokenizer) from the same seed
on the same random contiguous windows of real text, and is scored on the same fixed held-out
windows (the last --val_fraction of the tokens). Only the attention changes:

    dense        causal attention over every earlier key
    W,B,n        ANN attention: window W, blocks of B keys, top n blocks retrieved (exact)
    ...@S        the same config from seed S (model init and data order), to measure seed noise

    python benchmarks/ablate_ann.py --json docs/ann_ablation.json --png docs/ann_ablation.png
    python benchmarks/ablate_ann.py --steps 20 --configs dense 64,16,4 --json /tmp/a.json --png /tmp/a.png

tokens_per_s counts CPU seconds of this process (time.process_time), so on a machine shared with
other jobs it still measures the model, not the neighbours; with --threads 1 it is what an idle
core would give. tokens_per_wall_s is the plain wall-clock rate. The JSON is rewritten after every
config, so an interrupted run keeps the rows it finished.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from evaluation.loading import SHIPPED_TOKENIZER
from model import MiniMindConfig, MiniMindForCausalLM
from trainer.optim import learning_rate_at

DEFAULT_CONFIGS = [
    "dense", "64,16,0", "64,16,2", "64,16,4", "32,16,4", "128,16,4", "64,8,8", "64,32,2", "dense@1", "64,16,4@1",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="dense | W,B,n, each optionally @seed")
    p.add_argument("--data", default="/work/shared/data/tinyshakespeare.txt")
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--val_windows", type=int, default=32, help="held-out windows of seq_len scored per config")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps before the cosine decay")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seed of configs without @seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="docs/ann_ablation.json")
    p.add_argument("--png", default="docs/ann_ablation.png")
    args = p.parse_args(argv)
    try:
        args.runs = [parse_run(spec, args.seed) for spec in args.configs]
    except ValueError as error:
        p.error(str(error))
    return args


def parse_run(spec, default_seed):
    """'dense', '64,16,4' or either with '@seed' -> dict(attn, window, block, top_n, seed)."""
    name, _, seed = spec.partition("@")
    run = dict(attn="dense", window=None, block=None, top_n=None, seed=int(seed) if seed else default_seed)
    if name == "dense":
        return run
    try:
        window, block, top_n = (int(part) for part in name.split(","))
    except ValueError:
        raise ValueError(f"config {spec!r}: expected 'dense' or 'W,B,n' (e.g. 64,16,4), optionally '@seed'") from None
    return dict(run, attn="ann", window=window, block=block, top_n=top_n)


def run_label(run):
    name = "dense" if run["attn"] == "dense" else f"W{run['window']} B{run['block']} n{run['top_n']}"
    return f"{name} @{run['seed']}"


def load_tokens(path, val_fraction):
    transformers_logging.set_verbosity_error()  # the long-text warning is about the model, not tokenizing
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    ids = torch.tensor(tokenizer(Path(path).read_text(encoding="utf-8"))["input_ids"], dtype=torch.long)
    split = int(len(ids) * (1 - val_fraction))
    return ids[:split], ids[split:], tokenizer.vocab_size


def model_config(args, run, vocab_size):
    ann = {} if run["attn"] == "dense" else dict(ann_window=run["window"], ann_block_size=run["block"], ann_top_n=run["top_n"])
    return MiniMindConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        attn_impl=run["attn"],
        **ann,
    )


@torch.no_grad()
def validation_loss(model, val_ids, args):
    count = min(args.val_windows, len(val_ids) // args.seq_len)
    windows = val_ids[: count * args.seq_len].view(count, args.seq_len)
    model.eval()
    total = sum(model(batch, labels=batch).loss.item() * len(batch) for batch in windows.split(args.batch_size))
    model.train()
    return total / count


def train_and_score(args, run, train_ids, val_ids, vocab_size):
    torch.manual_seed(run["seed"])
    model = MiniMindForCausalLM(model_config(args, run, vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data_order = torch.Generator().manual_seed(run["seed"])
    recent_losses = []
    began_wall, began_cpu = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - args.seq_len, (args.batch_size,), generator=data_order)
        batch = torch.stack([train_ids[start : start + args.seq_len] for start in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, args.steps, args.lr, args.warmup)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent_losses = (recent_losses + [loss.item()])[-10:]
    wall_seconds, cpu_seconds = time.perf_counter() - began_wall, time.process_time() - began_cpu
    tokens = args.steps * args.batch_size * args.seq_len
    return dict(
        run,
        val_loss=round(validation_loss(model, val_ids, args), 4),
        train_loss=round(sum(recent_losses) / len(recent_losses), 4),
        tokens_per_s=round(tokens / cpu_seconds, 1),
        tokens_per_wall_s=round(tokens / wall_seconds, 1),
        steps=args.steps,
        train_seconds=round(wall_seconds, 1),
    )


def plot(rows, threads, path):
    """Validation loss and training speed per config; rows from another seed are dots on their bar."""
    by_config = {}
    for row in rows:
        by_config.setdefault((row["attn"], row["window"], row["block"], row["top_n"]), []).append(row)
    groups = list(by_config.values())
    labels = [run_label(group[0]).rsplit(" @", 1)[0] for group in groups]
    colours = ["#4c78a8" if group[0]["attn"] == "dense" else "#f58518" for group in groups]
    positions = range(len(groups))

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    first_losses = [group[0]["val_loss"] for group in groups]
    ax_loss.bar(positions, first_losses, color=colours)
    for x, group in zip(positions, groups):
        ax_loss.text(x, group[0]["val_loss"], f"{group[0]['val_loss']:.3f}", ha="center", va="bottom", fontsize=7)
        for row in group[1:]:
            ax_loss.plot(x, row["val_loss"], "ko", ms=4)
    all_losses = [row["val_loss"] for row in rows]
    spread = max(all_losses) - min(all_losses)
    ax_loss.set_ylim(min(all_losses) - max(spread, 0.02), max(all_losses) + 0.3 * max(spread, 0.02))
    ax_loss.set_ylabel("validation loss (nats/token)")
    ax_loss.set_title("held-out loss (bars: first seed, dots: other seeds)", fontsize=9)

    ax_speed.bar(positions, [sum(r["tokens_per_s"] for r in g) / len(g) for g in groups], color=colours)
    ax_speed.set_ylabel("train tokens / CPU second")
    ax_speed.set_title(f"training throughput, {threads} thread(s) (mean over seeds)", fontsize=9)
    for ax in (ax_loss, ax_speed):
        ax.set_xticks(list(positions))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    train_ids, val_ids, vocab_size = load_tokens(args.data, args.val_fraction)
    if len(val_ids) < args.seq_len or len(train_ids) <= args.seq_len:
        raise SystemExit(f"{args.data}: too little text for windows of {args.seq_len} tokens")
    settings = {key: value for key, value in vars(args).items() if key not in ("configs", "runs", "json", "png")}
    settings.update(
        train_tokens=len(train_ids),
        val_tokens=len(val_ids),
        val_windows_used=min(args.val_windows, len(val_ids) // args.seq_len),
        torch=torch.__version__,
        machine=platform.processor() or platform.machine(),
    )
    rows = []
    for run in args.runs:
        row = train_and_score(args, run, train_ids, val_ids, vocab_size)
        rows.append(row)
        print(f"{run_label(row):>20}  val_loss {row['val_loss']:.4f}  train_loss {row['train_loss']:.4f}  "
              f"{row['tokens_per_s']:>7.0f} tok/cpu-s  {row['train_seconds']:.0f} s wall", flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": settings, "rows": rows}, indent=2) + "\n")
    plot(rows, args.threads, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
