"""The one training loop behind train_pretrain.py and train_full_sft.py.

A stage script describes itself with a `Stage` (dataset class, default paths and hyperparameters)
and calls `main(stage)`. Everything else lives here, top to bottom:

    command line -> validation (exit 2, before any data is read) -> distributed setup ->
    model, data, optimizer -> optional resume -> loop -> final checkpoint, model, plot, report.

Exact resume. The data order of an epoch is a permutation drawn from (seed, epoch), and a checkpoint
records how many samples of that order all ranks together have consumed, together with model,
optimizer, scaler and every RNG state. A run killed at any point and restarted with
`--from_resume 1` therefore replays the same batches with the same weights: on CPU in one process
its losses are bitwise equal to an uninterrupted run. Counted in samples, the position also
carries over to another number of processes: with the same global batch (--batch_size x processes)
the batches are the same and the losses equal up to float rounding.

Exit codes: 0 done (also when --max_minutes stops early), 2 bad arguments or bad data,
3 non-finite loss (the last good checkpoint is kept).
"""

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import AutoTokenizer

from dataset.lm_dataset import DataFormatError, resolve_data_path
from model.config import MAX_TOKEN_SHIFT, MiniMindConfig
from common.cpu_memory import retain_freed_memory
from model.attention import Attention
from model.model import MiniMindForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_KEYS = ("model", "config", "optimizer", "scaler", "state", "rng", "args")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """A bad command line or bad input file: reported in one line, exit code 2."""


class NonFiniteLoss(Exception):
    """The loss became nan/inf: reported with its step, exit code 3."""


@dataclass
class Stage:
    name: str  # "pretrain" or "sft", also the key for resolve_data_path
    dataset_class: type
    learning_rate: float
    epochs: int
    batch_size: int
    accumulation_steps: int
    max_seq_len: int
    out_dir: str


# ----------------------------------------------------------------------------- command line


def parse_args(stage, argv=None):
    p = argparse.ArgumentParser(description=f"MiniMind {stage.name} training")
    p.add_argument("--out_dir", default=stage.out_dir)
    p.add_argument("--epochs", type=int, default=stage.epochs)
    p.add_argument("--batch_size", type=int, default=stage.batch_size)
    p.add_argument("--learning_rate", type=float, default=stage.learning_rate)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--accumulation_steps", type=int, default=stage.accumulation_steps)
    p.add_argument("--grad_clip", type=float, default=1.0, help="max gradient norm; 0 disables clipping")
    p.add_argument("--max_steps", type=int, default=-1, help="cap on optimizer steps; -1: the epochs decide")
    p.add_argument("--max_minutes", type=float, default=None, help="stop cleanly (checkpoint + model) after this")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="autocast dtype on CUDA; CPU uses fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data_path", default=None, help="default: the stage's dataset, see dataset/lm_dataset.py")
    p.add_argument("--skip_bad_lines", action="store_true", help="skip malformed JSONL lines instead of failing")
    p.add_argument("--max_seq_len", type=int, default=stage.max_seq_len)
    p.add_argument("--tokenizer_path", default=str(REPO_ROOT / "model" / "tokenizer"))
    p.add_argument("--preset", default=None, help="tiny | small | base (default tiny, or the --from_weight model)")
    p.add_argument("--hidden_size", type=int, default=None, help="overrides the preset")
    p.add_argument("--num_hidden_layers", type=int, default=None, help="overrides the preset")
    p.add_argument("--num_attention_heads", type=int, default=None, help="overrides the preset")
    p.add_argument("--num_key_value_heads", type=int, default=None, help="overrides the preset")
    p.add_argument("--rope_theta", type=float, default=None, help="RoPE base (default 1e6)")
    p.add_argument("--key_shift", type=int, choices=range(MAX_TOKEN_SHIFT + 1), default=None,
                   help="previous tokens each key mixes in (smeared keys, see model/model.py); default 0")
    p.add_argument("--query_shift", type=int, choices=range(MAX_TOKEN_SHIFT + 1), default=None,
                   help="previous tokens each query mixes in; default 0")
    p.add_argument("--wide_shift_from_step", type=int, default=0,
                   help="hold the token shift beyond a key's first previous token (a key's second, every "
                        "query's) fixed until this optimizer step; a new model's is zero, so with --key_shift 2 "
                        "it first trains as with --key_shift 1")
    p.add_argument("--attn", default=None, help="ann | dense (default ann, or the --from_weight model's)")
    p.add_argument("--ann_window", type=int, default=None)
    p.add_argument("--ann_block_size", type=int, default=None)
    p.add_argument("--ann_top_n", type=int, default=None)
    p.add_argument("--ann_retrieval", default=None, help="exact | hnsw | auto")
    p.add_argument("--ann_block_position", default=None, help="capped | true: where retrieved keys sit for RoPE")
    p.add_argument("--ann_block_summary", default=None, help="bounds | mean: how a block is scored for retrieval")
    p.add_argument("--hnsw_ef_search", type=int, default=None,
                   help="HNSW search breadth saved with the model (used when it retrieves with hnsw); default 64")
    p.add_argument("--from_weight", default="none", help="saved model folder of an earlier stage, or 'none'")
    p.add_argument("--from_resume", type=int, choices=[0, 1], default=0, help="1: continue from out_dir/checkpoints")
    p.add_argument("--log_interval", type=int, default=10, help="optimizer steps between metrics lines")
    p.add_argument("--save_interval", type=int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--keep_checkpoints", type=int, default=2)
    p.add_argument("--use_wandb", action="store_true")
    p.add_argument("--wandb_project", default="MiniMind")
    return p.parse_args(argv)


def validate_args(args):
    at_least = {
        "epochs": 1, "batch_size": 1, "accumulation_steps": 1, "max_seq_len": 2, "log_interval": 1,
        "save_interval": 1, "keep_checkpoints": 1, "warmup_steps": 0, "num_workers": 0,
        "wide_shift_from_step": 0,
    }
    for name, low in at_least.items():
        if getattr(args, name) < low:
            raise UsageError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.max_steps != -1 and args.max_steps < 1:
        raise UsageError(f"--max_steps must be -1 (no cap) or >= 1, got {args.max_steps}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise UsageError(f"--learning_rate must be a positive number, got {args.learning_rate}")
    if not args.grad_clip >= 0:
        raise UsageError(f"--grad_clip must be >= 0 (0 disables clipping), got {args.grad_clip}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise UsageError(f"--max_minutes must be > 0, got {args.max_minutes}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device} requested but CUDA is not available")
    if args.data_path is not None and not Path(args.data_path).is_file():
        raise UsageError(f"--data_path {args.data_path}: file not found")
    if not Path(args.tokenizer_path).is_dir():
        raise UsageError(f"tokenizer folder not found: {args.tokenizer_path}")
    if args.from_weight != "none" and not (Path(args.from_weight) / "config.json").is_file():
        raise UsageError(f"--from_weight {args.from_weight}: not a saved model folder (no config.json)")
    if args.use_wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError("--use_wandb needs the wandb package, which is not installed") from None


def build_config(args):
    """The model config from --preset/--hidden_size/... or from the --from_weight folder; ValueError -> UsageError."""
    attention = dict(
        attn_impl=args.attn if args.attn or args.from_weight != "none" else "ann",
        ann_window=args.ann_window,
        ann_block_size=args.ann_block_size,
        ann_top_n=args.ann_top_n,
        ann_retrieval=args.ann_retrieval,
        ann_block_position=args.ann_block_position,
        ann_block_summary=args.ann_block_summary,
        hnsw_ef_search=args.hnsw_ef_search,
    )
    architecture = {
        name: getattr(args, name)
        for name in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "rope_theta", "key_shift", "query_shift",
        )
    }
    try:
        if args.from_weight == "none":
            return MiniMindConfig.from_preset(args.preset or "tiny", **architecture, **attention)
        config = MiniMindConfig.from_pretrained(args.from_weight)
        # The weights fix the architecture; its flags may only restate it.
        requested = architecture
        if args.preset:
            preset = MiniMindConfig.from_preset(args.preset, **requested)
            requested = {name: getattr(preset, name) for name in requested}
        conflicts = [
            f"{name}={value} (the model has {getattr(config, name)})"
            for name, value in requested.items()
            if value is not None and value != getattr(config, name)
        ]
        if conflicts:
            raise UsageError(f"architecture flags conflict with the --from_weight model: {', '.join(conflicts)}")
        # Attention settings change no weights, so a later stage may switch them.
        for name, value in attention.items():
            if value is not None:
                setattr(config, name, value)
        config.validate_settings()
        return config
    except ValueError as error:
        raise UsageError(str(error)) from None


# ----------------------------------------------------------------------------- distributed


def setup_distributed(device_name):
    """(rank, world_size, device); under torchrun (WORLD_SIZE > 1) joins the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, torch.device(device_name)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device_name.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return rank, world_size, torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return rank, world_size, torch.device("cpu")


class EpochPlan:
    """Which micro-batches of which samples each rank sees in each epoch.

    Like DistributedSampler, the permutation is padded by wrapping so all ranks get the same
    number of micro-batches (an uneven count would hang DDP); unlike it, the order is a pure
    function of (seed, epoch), so a checkpoint only has to store how far into it we are.
    Micro-batch m of all ranks together is samples [m * B, (m + 1) * B) of the padded order, with
    B = batch_size * world_size, whatever the world size.
    """

    def __init__(self, num_samples, batch_size, accumulation_steps, seed, rank, world_size):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.per_rank = math.ceil(num_samples / world_size)
        self.samples_per_micro_batch = batch_size * world_size  # all ranks together
        self.micro_batches = math.ceil(self.per_rank / batch_size)
        self.steps = math.ceil(self.micro_batches / accumulation_steps)

    def batches(self, epoch):
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        order = np.resize(order, self.per_rank * self.world_size)  # wraps around to pad
        mine = order[self.rank :: self.world_size].tolist()
        return [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]


def all_ranks_sum(values, world_size):
    if world_size > 1:
        dist.all_reduce(values)
    return values


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_path(out_dir, step):
    return Path(out_dir) / "checkpoints" / f"step_{step:07d}.pt"


def list_checkpoints(out_dir):
    """Checkpoint files, newest (highest step) first."""
    return sorted((Path(out_dir) / "checkpoints").glob("step_*.pt"), reverse=True)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir, step, payload, keep):
    """Write atomically (a crash leaves either the old set of files or the new one), keep the last `keep`."""
    path = checkpoint_path(out_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    for old in list_checkpoints(out_dir)[keep:]:
        old.unlink()
    return path


def load_latest_checkpoint(out_dir):
    """(path, payload) of the newest readable checkpoint, or (None, None).

    Unreadable files (a partial write from a crash, disk corruption) are renamed to *.corrupt with a
    warning, so they are never picked again nor counted among the checkpoints to keep.
    """
    for path in list_checkpoints(out_dir):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
            missing = [key for key in CHECKPOINT_KEYS if key not in payload]
            if missing:
                raise ValueError(f"missing {missing}")
            return path, payload
        except Exception as error:  # any failure to read means the file is useless to us
            print(f"warning: skipping unreadable checkpoint {path} ({type(error).__name__}: {error})", file=sys.stderr)
            path.rename(path.with_name(path.name + ".corrupt"))
    return None, None


def rng_states():
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ----------------------------------------------------------------------------- metrics


def truncate_metrics(metrics_path, last_step):
    """Drop lines logged after the checkpoint we resume from (they will be logged again)."""
    if not metrics_path.exists():
        return
    kept = []
    for line in metrics_path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by the crash
    tmp = metrics_path.with_name(metrics_path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, metrics_path)


def plot_metrics(metrics_path, png_path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, loss_axis = plt.subplots(figsize=(8, 4.5))
    loss_axis.plot([r["step"] for r in records], [r["loss"] for r in records], color="tab:blue")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss", color="tab:blue")
    lr_axis = loss_axis.twinx()
    lr_axis.plot([r["step"] for r in records], [r["lr"] for r in records], color="tab:orange", alpha=0.5)
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    loss_axis.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- training


def learning_rate_at(step, total_steps, peak, warmup_steps):
    """Linear warmup to `peak`, then cosine decay to peak/10 at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak / 10 + 0.45 * peak * (1 + math.cos(math.pi * min(1.0, progress)))


def wide_shift_weights(model):
    """[(parameter, first row)]: the token-shift rows beyond a key's one previous token, i.e. every key
    row from the second on and every query row. --wide_shift_from_step holds them until then (no
    gradient, no weight decay); a new model's start at zero, so until that step a --key_shift 2 model
    computes exactly what a --key_shift 1 model computes. Learning the copy with the one-token match
    first and the two-token match after is what forms both within the long-context budget
    (docs/LONG_CONTEXT.md)."""
    rows = []
    for module in model.modules():
        if isinstance(module, Attention):
            if module.k_shift is not None and len(module.k_shift) > 1:
                rows.append((module.k_shift, 1))
            if module.q_shift is not None:
                rows.append((module.q_shift, 0))
    return rows


def build_optimizer(model, learning_rate):
    # Decay matrices (linear layers, embeddings), not norms and biases: the nanoGPT/minimind recipe.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


@dataclass
class Progress:
    """Where training stands; with the EpochPlan it fixes exactly which micro-batch comes next."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples: int = 0  # samples of this epoch's order consumed, all ranks together
    tokens_seen: int = 0  # supervised (label != -100) tokens, all ranks
    elapsed_s: float = 0.0  # training wall time of earlier runs (resume)


def resume(out_dir, args, model, optimizer, scaler, rank, world_size):
    """Load the newest readable checkpoint into model/optimizer/scaler/RNGs: (path, Progress), or (None, None).

    Rank 0 picks the file (and sets corrupt ones aside); the other ranks then load the same one.
    """
    found, payload = [None], None
    if rank == 0:
        found[0], payload = load_latest_checkpoint(out_dir)
    if world_size > 1:
        dist.broadcast_object_list(found)
    path = found[0]
    if path is None:
        return None, None
    if payload is None:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    try:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        raise UsageError(f"{path} was saved for a different model than this command line builds ({first_line})")
    if scaler.is_enabled() and payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    state = dict(payload["state"])
    saved_world_size = state.pop("world_size")
    changed = [f"--{name}" for name in ("seed", "accumulation_steps", "max_seq_len", "data_path")
               if payload["args"][name] != getattr(args, name)]
    if payload["args"]["batch_size"] * saved_world_size != args.batch_size * world_size:
        changed.append("the global batch (--batch_size x processes)")
    if saved_world_size == world_size:
        restore_rng_states(payload["rng"][rank])
    elif model.config.dropout > 0:
        changed.append("the number of processes (so the dropout draws)")
    if changed and rank == 0:
        print(f"warning: {', '.join(changed)} differ from the checkpoint's; the run will not continue exactly")
    return path, Progress(**state)


def prepare_out_dir(out_dir, resumed_step):
    """Rank 0: drop what a resumed run will redo, or everything an earlier run left when starting fresh."""
    checkpoint_dir, metrics_path = out_dir / "checkpoints", out_dir / "metrics.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    for partial in checkpoint_dir.glob(".step_*.tmp*"):
        partial.unlink()  # left by a run killed while saving
    if resumed_step is not None:
        truncate_metrics(metrics_path, resumed_step)
        return
    # Old checkpoints would otherwise be taken for this run's by rotation and by a later --from_resume.
    old_checkpoints = list_checkpoints(out_dir)
    if old_checkpoints or metrics_path.exists():
        print(f"starting fresh: replacing the metrics and checkpoints of an earlier run in {out_dir}")
    metrics_path.unlink(missing_ok=True)
    for old in old_checkpoints:
        old.unlink()


def train(stage, args, config, rank, world_size, device):
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(args.out_dir)
    metrics_path = out_dir / "metrics.jsonl"

    amp_dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    if device.type == "cpu" and args.dtype != "float32":
        say(f"note: --dtype {args.dtype} applies to CUDA only; on CPU the model computes in float32")
    autocast = torch.autocast("cuda", dtype=amp_dtype) if amp_dtype != torch.float32 else contextlib.nullcontext()
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)  # DDP broadcasts rank 0's initial weights, so only dropout differs

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    if args.from_weight == "none":
        model = MiniMindForCausalLM(config)
    else:
        model = MiniMindForCausalLM.from_pretrained(args.from_weight, config=config)
    model.to(device)
    try:
        data_path = resolve_data_path(stage.name, args.data_path)
        dataset = stage.dataset_class(data_path, tokenizer, args.max_seq_len, skip_bad_lines=args.skip_bad_lines)
    except (DataFormatError, FileNotFoundError) as error:
        raise UsageError(str(error)) from None

    optimizer = build_optimizer(model, args.learning_rate)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    plan = EpochPlan(len(dataset), args.batch_size, args.accumulation_steps, args.seed, rank, world_size)
    total_steps = args.epochs * plan.steps
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    last_checkpoint, progress = None, None
    if args.from_resume:
        last_checkpoint, progress = resume(out_dir, args, model, optimizer, scaler, rank, world_size)
        if progress is None:
            say(f"no usable checkpoint in {out_dir / 'checkpoints'}; starting from scratch")
        else:
            say(f"resumed from {last_checkpoint} (step {progress.step}, epoch {progress.epoch + 1})")
    progress = progress or Progress()
    # Held rows keep the values they start (or resume) with: zeroed gradients leave Adam's moments
    # at zero, and restoring the values after each step undoes weight decay on a nonzero start.
    held_shift = [(weight, first_row, weight.detach()[first_row:].clone())
                  for weight, first_row in wide_shift_weights(model)] if args.wide_shift_from_step else []
    if is_main:
        prepare_out_dir(out_dir, progress.step if last_checkpoint else None)
    wandb_run = None
    if args.use_wandb and is_main:
        import wandb

        wandb_run = wandb.init(project=args.wandb_project, name=f"{stage.name}-{out_dir.name}", config=vars(args))

    start = "" if args.from_weight == "none" else f", starting from {args.from_weight}"
    say(
        f"{stage.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"({config.attn_impl} attention{start}), {len(dataset)} samples, {plan.steps} optimizer steps/epoch, "
        f"{total_steps} in total, device {device}" + (f" x{world_size}" if world_size > 1 else "")
    )
    raw_model = model
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    start_time = time.time()

    def save_now():
        # Every rank contributes its RNG state, so dropout also resumes exactly on every rank.
        states = [None] * world_size
        if world_size > 1:
            dist.all_gather_object(states, rng_states())
        else:
            states[0] = rng_states()
        if not is_main:
            return None
        state = {**vars(progress), "elapsed_s": progress.elapsed_s + time.time() - start_time}
        payload = {
            "model": raw_model.state_dict(),
            "config": raw_model.config.to_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "state": {**state, "world_size": world_size},
            "rng": states,
            "args": vars(args),
        }
        return save_checkpoint(out_dir, progress.step, payload, args.keep_checkpoints)

    log_time, log_tokens = start_time, progress.tokens_seen
    saved_step = progress.step if last_checkpoint else None
    stop_reason = None
    bar = tqdm(total=total_steps, initial=progress.step, disable=not is_main, dynamic_ncols=True, desc=stage.name)
    model.train()
    while progress.step < total_steps and progress.epoch < args.epochs and not stop_reason:
        batches = plan.batches(progress.epoch)
        # Rounds down, repeating a few samples, only when the global batch differs from the checkpoint's.
        position = progress.samples // plan.samples_per_micro_batch
        # An explicit generator keeps the DataLoader from drawing on the global torch RNG we checkpoint.
        loader = DataLoader(
            dataset,
            batch_sampler=batches[position:],
            num_workers=args.num_workers,
            pin_memory=device.type == "cuda",
            generator=torch.Generator(),
        )
        group_loss = torch.zeros((), device=device)
        group_tokens = torch.zeros((), device=device)
        for micro_index, (input_ids, labels) in enumerate(loader, start=position):
            # Micro-batches group into optimizer steps of accumulation_steps; an epoch's last group may be short.
            group_start = micro_index - micro_index % args.accumulation_steps
            group_size = min(args.accumulation_steps, len(batches) - group_start)
            last_in_group = micro_index == group_start + group_size - 1
            # Right padding past the last label changes no loss of a causal model: cut it off.
            length = int((labels != -100).any(dim=0).nonzero().max()) + 1 if bool((labels != -100).any()) else 1
            input_ids = input_ids[:, :length].to(device, non_blocking=True)
            labels = labels[:, :length].to(device, non_blocking=True)
            with model.no_sync() if world_size > 1 and not last_in_group else contextlib.nullcontext():
                with autocast:
                    loss = model(input_ids=input_ids, labels=labels).loss
                scaler.scale(loss / group_size).backward()
            group_loss += loss.detach().float() / group_size
            group_tokens += (labels != -100).sum()
            if not last_in_group:
                continue

            lr = learning_rate_at(progress.step, total_steps, args.learning_rate, args.warmup_steps)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            # One all-reduce per step agrees on loss, tokens and rank 0's clock, so all ranks stop together.
            out_of_time = is_main and args.max_minutes is not None and time.time() - start_time > args.max_minutes * 60
            stop_flag = torch.tensor(float(out_of_time), device=device)
            summed = all_ranks_sum(torch.stack([group_loss, group_tokens, stop_flag]).double(), world_size).tolist()
            step_loss = summed[0] / world_size
            if not math.isfinite(step_loss):
                raise NonFiniteLoss(
                    f"non-finite loss ({step_loss}) at step {progress.step + 1} (epoch {progress.epoch + 1}); "
                    f"stopped. Last good checkpoint: {last_checkpoint or 'none'}"
                )
            if progress.step < args.wide_shift_from_step:
                for weight, first_row, _ in held_shift:
                    if weight.grad is not None:
                        weight.grad[first_row:] = 0
            if args.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            if progress.step < args.wide_shift_from_step:
                with torch.no_grad():
                    for weight, first_row, start_value in held_shift:
                        weight[first_row:] = start_value
            optimizer.zero_grad(set_to_none=True)
            group_loss.zero_()
            group_tokens.zero_()
            progress.step += 1
            progress.samples = (micro_index + 1) * plan.samples_per_micro_batch
            progress.tokens_seen += int(summed[1])
            if summed[2] > 0:
                stop_reason = f"--max_minutes {args.max_minutes} reached"

            if is_main:
                now = time.time()
                tokens_per_s = (progress.tokens_seen - log_tokens) / max(now - log_time, 1e-9)
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
                bar.update(1)
                if progress.step % args.log_interval == 0 or progress.step == total_steps or stop_reason:
                    record = {
                        "step": progress.step, "epoch": progress.epoch, "loss": step_loss, "lr": lr,
                        "tokens_per_s": round(tokens_per_s, 1),
                        "elapsed_s": round(progress.elapsed_s + now - start_time, 3),
                        "tokens_seen": progress.tokens_seen,
                    }
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    if wandb_run is not None:
                        wandb_run.log(record, step=progress.step)
                    log_time, log_tokens = now, progress.tokens_seen
            if progress.step % args.save_interval == 0:
                last_checkpoint, saved_step = save_now(), progress.step
            if stop_reason or progress.step >= total_steps:
                break
        if progress.samples >= len(batches) * plan.samples_per_micro_batch:
            progress.epoch, progress.samples = progress.epoch + 1, 0
    bar.close()

    if progress.step > 0 and saved_step != progress.step:
        last_checkpoint = save_now()
    if not is_main:
        return
    if wandb_run is not None:
        wandb_run.finish()
    if stop_reason:
        say(f"stopped early at step {progress.step}/{total_steps}: {stop_reason}; continue with --from_resume 1")
    model_dir, png_path = out_dir / "model", out_dir / "loss.png"
    raw_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    if metrics_path.exists():
        plot_metrics(metrics_path, png_path, f"MiniMind {stage.name} ({config.attn_impl} attention)")
    say(f"dataset report: {json.dumps(dataset.report(), ensure_ascii=False)}")
    say(f"model:      {model_dir}")
    say(f"metrics:    {metrics_path}")
    say(f"loss plot:  {png_path}")
    say(f"checkpoint: {last_checkpoint}")


def main(stage, argv=None):
    try:
        args = parse_args(stage, argv)
        validate_args(args)
        config = build_config(args)
        if args.max_seq_len > config.max_position_embeddings:
            raise UsageError(
                f"--max_seq_len {args.max_seq_len} exceeds the model's {config.max_position_embeddings} positions"
            )
        if args.wide_shift_from_step and config.key_shift < 2 and not config.query_shift:
            raise UsageError(
                f"--wide_shift_from_step {args.wide_shift_from_step} holds back a token shift the model does "
                f"not have (key_shift {config.key_shift}, query_shift {config.query_shift}): "
                "it needs --key_shift 2 or --query_shift >= 1"
            )
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    retain_freed_memory()
    rank, world_size, device = setup_distributed(args.device)
    try:
        train(stage, args, config, rank, world_size, device)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except NonFiniteLoss as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(3) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
