"""Checkpoints: atomic writes, the newest readable one, and resuming a run exactly from it.

Exact resume. The data order of an epoch is a permutation drawn from (seed, epoch) (trainer/data.py),
and a checkpoint records how many samples of that order all ranks together have consumed, together
with model, optimizer, scaler, every RNG state and the model's training state (the distractor
memories of cross-batch training). A run killed at any point and restarted with
`--from_resume 1` therefore replays the same batches with the same weights: on CPU in one process
its losses are bitwise equal to an uninterrupted run. Counted in samples, the position also
carries over to another number of processes: with the same global batch (--batch_size x processes)
the batches are the same and the losses equal up to float rounding.
"""

import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.cli import UsageError
from trainer.distributed import from_rank_0, gather_from_all_ranks
from trainer.metrics import truncate_metrics

CHECKPOINT_KEYS = ("model", "config", "optimizer", "scaler", "state", "rng", "args")
TRAINING_ARGS_FILE = "training_args.json"  # in a saved model folder: the trainer's arguments, as JSON


@dataclass
class Progress:
    """Where training stands; with the EpochPlan it fixes exactly which micro-batch comes next."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples: int = 0  # samples of this epoch's order consumed, all ranks together
    tokens_seen: int = 0  # supervised (label != -100) tokens, all ranks
    elapsed_s: float = 0.0  # training wall time of earlier runs (resume)


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


def save_training_state(out_dir, keep, model, optimizer, scaler, progress, elapsed_s, args, rank, world_size):
    """The checkpoint of step progress.step. Every rank calls this; rank 0 writes it and returns its path, the others None.

    model: the unwrapped model; elapsed_s: training wall time so far, earlier runs included.
    """
    # Every rank contributes its RNG state and its model's training state (distractor memories), so
    # dropout and cross-batch distractors also resume exactly on every rank.
    states, training_states = zip(*gather_from_all_ranks((rng_states(), model.training_state()), world_size))
    if rank != 0:
        return None
    payload = {
        "model": model.state_dict(),
        "config": model.config.to_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "state": {**vars(progress), "elapsed_s": elapsed_s, "world_size": world_size},
        "rng": list(states),
        "training_state": list(training_states),
        "args": vars(args),
    }
    return save_checkpoint(out_dir, progress.step, payload, keep)


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


def resume(out_dir, args, model, optimizer, scaler, rank, world_size):
    """Load the newest readable checkpoint into model/optimizer/scaler/RNGs: (path, Progress), or (None, None).

    Rank 0 picks the file (and sets corrupt ones aside); the other ranks then load the same one.
    """
    path, payload = load_latest_checkpoint(out_dir) if rank == 0 else (None, None)
    path = from_rank_0(path, world_size)
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
        model.load_training_state(payload.get("training_state", [{}] * world_size)[rank])
    elif model.config.dropout > 0 or model.config.ann_distractor_memory:
        changed.append("the number of processes (so the dropout draws and the distractor memories)")
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
