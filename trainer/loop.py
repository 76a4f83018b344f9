"""The one training loop behind train_pretrain.py and train_full_sft.py.

A stage script describes itself with a `Stage` (trainer/cli.py: dataset class, default paths and
hyperparameters) and calls `main(stage)`:

    command line -> validation (exit 2, before any data is read) -> distributed setup ->
    model, data, optimizer -> optional resume -> loop -> final checkpoint, model, plot, report.

Exit codes: 0 done (also when --max_minutes stops early), 2 bad arguments or bad data,
3 non-finite loss (the last good checkpoint is kept).
"""

import contextlib
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoTokenizer

from common.cli import DTYPES, UsageError
from common.cpu_memory import retain_freed_memory
from model.model import MiniMindForCausalLM
from trainer.checkpoints import TRAINING_ARGS_FILE, Progress, prepare_out_dir, resume, save_training_state
from trainer.cli import build_config, parse_args, validate_args, validate_args_for_model
from trainer.data import EpochPlan, batch_loader, load_dataset, trim_padding
from trainer.distributed import all_ranks_sum, setup_distributed, teardown_distributed
from trainer.metrics import TrainingLog, plot_metrics, start_wandb
from trainer.optim import build_optimizer, optimizer_step, set_learning_rates


class NonFiniteLoss(Exception):
    """The loss became nan/inf: reported with its step, exit code 3."""


def train(stage, args, config, rank, world_size, device):
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(args.out_dir)
    metrics_path = out_dir / "metrics.jsonl"

    amp_dtype, autocast = mixed_precision(args.dtype, device, say)
    seed_everything(args.seed + rank)  # DDP broadcasts rank 0's initial weights, so only dropout differs

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    model = build_model(args, config).to(device)
    dataset = load_dataset(stage, args, tokenizer)
    optimizer = build_optimizer(model, args.learning_rate)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    plan = EpochPlan(len(dataset), args.batch_size, args.accumulation_steps, args.seed, rank, world_size)
    total_steps = args.epochs * plan.steps if args.max_steps < 0 else min(args.epochs * plan.steps, args.max_steps)

    last_checkpoint, progress = start_or_resume(out_dir, args, model, optimizer, scaler, rank, world_size, say)
    if is_main:
        prepare_out_dir(out_dir, progress.step if last_checkpoint else None)
    wandb_run = start_wandb(args, stage.name, out_dir) if args.use_wandb and is_main else None
    say(run_summary(stage.name, args.from_weight, model, dataset, plan, total_steps, device, world_size))
    raw_model = model
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    start_time = time.time()

    def save_now():
        elapsed_s = progress.elapsed_s + time.time() - start_time
        return save_training_state(out_dir, args.keep_checkpoints, raw_model, optimizer, scaler, progress,
                                   elapsed_s, args, rank, world_size)

    log = TrainingLog(metrics_path, stage.name, total_steps, progress, args.log_interval, start_time, wandb_run, is_main)
    saved_step = progress.step if last_checkpoint else None
    stop_reason = None
    model.train()
    while progress.step < total_steps and progress.epoch < args.epochs and not stop_reason:
        batches = plan.batches(progress.epoch)
        # Rounds down, repeating a few samples, only when the global batch differs from the checkpoint's.
        position = progress.samples // plan.samples_per_micro_batch
        loader = batch_loader(dataset, batches[position:], args.num_workers, pin_memory=device.type == "cuda")
        group_loss = torch.zeros((), device=device)
        group_tokens = torch.zeros((), device=device)
        for micro_index, (input_ids, labels) in enumerate(loader, start=position):
            group_size, last_in_group = accumulation_group(micro_index, args.accumulation_steps, len(batches))
            input_ids, labels = (t.to(device, non_blocking=True) for t in trim_padding(input_ids, labels))
            loss = forward_backward(model, input_ids, labels, autocast, scaler, group_size,
                                    sync=world_size == 1 or last_in_group)
            group_loss += loss.detach().float() / group_size
            group_tokens += (labels != -100).sum()
            if not last_in_group:
                continue

            lr = set_learning_rates(optimizer, progress.step, total_steps, args.learning_rate, args.warmup_steps,
                                    args.wide_shift_from_step, args.wide_shift_lr_scale)
            out_of_time = is_main and args.max_minutes is not None and time.time() - start_time > args.max_minutes * 60
            step_loss, step_tokens, stop = agree_across_ranks(group_loss, group_tokens, out_of_time, world_size)
            if not math.isfinite(step_loss):
                raise NonFiniteLoss(
                    f"non-finite loss ({step_loss}) at step {progress.step + 1} (epoch {progress.epoch + 1}); "
                    f"stopped. Last good checkpoint: {last_checkpoint or 'none'}"
                )
            optimizer_step(model, optimizer, scaler, args.grad_clip)
            group_loss.zero_()
            group_tokens.zero_()
            progress.step += 1
            progress.samples = (micro_index + 1) * plan.samples_per_micro_batch
            progress.tokens_seen += step_tokens
            if stop:
                stop_reason = f"--max_minutes {args.max_minutes} reached"

            log.record(progress, step_loss, lr, last=progress.step == total_steps or bool(stop_reason))
            if progress.step % args.save_interval == 0:
                last_checkpoint, saved_step = save_now(), progress.step
            if stop_reason or progress.step >= total_steps:
                break
        if progress.samples >= len(batches) * plan.samples_per_micro_batch:
            progress.epoch, progress.samples = progress.epoch + 1, 0
    log.close()

    if progress.step > 0 and saved_step != progress.step:
        last_checkpoint = save_now()
    if not is_main:
        return
    if wandb_run is not None:
        wandb_run.finish()
    if stop_reason:
        say(f"stopped early at step {progress.step}/{total_steps}: {stop_reason}; continue with --from_resume 1")
    write_outputs(stage, raw_model, tokenizer, dataset, out_dir, last_checkpoint, args)


def mixed_precision(dtype_name, device, say):
    """(compute dtype, its autocast context): autocast to --dtype on CUDA; CPU computes in float32."""
    amp_dtype = DTYPES[dtype_name] if device.type == "cuda" else torch.float32
    if device.type == "cpu" and dtype_name != "float32":
        say(f"note: --dtype {dtype_name} applies to CUDA only; on CPU the model computes in float32")
    autocast = torch.autocast("cuda", dtype=amp_dtype) if amp_dtype != torch.float32 else contextlib.nullcontext()
    return amp_dtype, autocast


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(args, config):
    if args.from_weight == "none":
        return MiniMindForCausalLM(config)
    return MiniMindForCausalLM.from_pretrained(args.from_weight, config=config)


def start_or_resume(out_dir, args, model, optimizer, scaler, rank, world_size, say):
    """(the checkpoint resumed from or None, Progress): with --from_resume 1 the newest readable checkpoint's."""
    if args.from_resume:
        last_checkpoint, progress = resume(out_dir, args, model, optimizer, scaler, rank, world_size)
        if progress is not None:
            say(f"resumed from {last_checkpoint} (step {progress.step}, epoch {progress.epoch + 1})")
            return last_checkpoint, progress
        say(f"no usable checkpoint in {out_dir / 'checkpoints'}; starting from scratch")
    return None, Progress()


def run_summary(stage_name, from_weight, model, dataset, plan, total_steps, device, world_size):
    start = "" if from_weight == "none" else f", starting from {from_weight}"
    return (
        f"{stage_name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"({model.config.attn_impl} attention{start}), {len(dataset)} samples, {plan.steps} optimizer steps/epoch, "
        f"{total_steps} in total, device {device}" + (f" x{world_size}" if world_size > 1 else "")
    )


def forward_backward(model, input_ids, labels, autocast, scaler, group_size, sync):
    """One micro-batch's loss (0-dim); its scaled gradient / group_size is added to the parameters' .grad.

    sync False skips DDP's gradient all-reduce, which the group's last micro-batch then does for all.
    """
    with contextlib.nullcontext() if sync else model.no_sync():
        with autocast:
            loss = model(input_ids=input_ids, labels=labels).loss
        scaler.scale(loss / group_size).backward()
    return loss


def accumulation_group(micro_index, accumulation_steps, micro_batches):
    """(size of the optimizer step's group of micro-batches that micro_index falls in, whether it is the group's last).

    Micro-batches group into optimizer steps of accumulation_steps; an epoch's last group may be short.
    """
    group_start = micro_index - micro_index % accumulation_steps
    group_size = min(accumulation_steps, micro_batches - group_start)
    return group_size, micro_index == group_start + group_size - 1


def agree_across_ranks(group_loss, group_tokens, out_of_time, world_size):
    """(mean loss over ranks, supervised tokens of all ranks, whether rank 0 is out of time).

    One all-reduce per step agrees on loss, tokens and rank 0's clock, so all ranks stop together.
    """
    stop_flag = torch.tensor(float(out_of_time), device=group_loss.device)
    loss, tokens, stop = all_ranks_sum(torch.stack([group_loss, group_tokens, stop_flag]).double(), world_size).tolist()
    return loss / world_size, int(tokens), stop > 0


def write_outputs(stage, model, tokenizer, dataset, out_dir, last_checkpoint, args):
    """Rank 0 at the end: the model folder (with the arguments that trained it, so an evaluation can
    say which seed and recipe it measured) and loss plot, then where everything is."""
    model_dir, png_path, metrics_path = out_dir / "model", out_dir / "loss.png", out_dir / "metrics.jsonl"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (model_dir / TRAINING_ARGS_FILE).write_text(json.dumps(vars(args), indent=2, default=str) + "\n", encoding="utf-8")
    if metrics_path.exists():
        plot_metrics(metrics_path, png_path, f"MiniMind {stage.name} ({model.config.attn_impl} attention)")
    print(f"dataset report: {json.dumps(dataset.report(), ensure_ascii=False)}")
    print(f"model:      {model_dir}")
    print(f"metrics:    {metrics_path}")
    print(f"loss plot:  {png_path}")
    print(f"checkpoint: {last_checkpoint}")


def main(stage, argv=None):
    try:
        args = parse_args(stage, argv)
        validate_args(args)
        config = build_config(args)
        validate_args_for_model(args, config)
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
        teardown_distributed()
