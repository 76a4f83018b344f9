"""The optimizer: AdamW parameter groups, the learning-rate schedule, and one optimizer step.

Holding the wide token shift (--wide_shift_from_step S). The token-shift weights beyond a key's
first previous token (every Attention's k_shift_wide and q_shift) have an AdamW group of their own
whose learning rate the schedule sets to 0 until step S. With lr 0, AdamW's decoupled weight decay
(p *= 1 - lr * wd) and its update (p -= lr * m / (sqrt(v) + eps)) leave them exactly as they are,
and the gradient-norm clip leaves them out. A new model's are zero, so until S a --key_shift 2 model
computes what a --key_shift 1 model computes. Learning the copy with the one-token match first and
the two-token match after is what forms both within the long-context budget (docs/LONG_CONTEXT_EXPERIMENTS.md).
--wide_shift_lr_scale K trains the group, once released, at K times the schedule's rate: its weights
start at zero, and at a low rate they stay near it.
"""

import math

import torch

from model.attention import Attention

WEIGHT_DECAY = 0.1


def learning_rate_at(step, total_steps, peak, warmup_steps):
    """Linear warmup to `peak`, then cosine decay to peak/10 at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak / 10 + 0.45 * peak * (1 + math.cos(math.pi * min(1.0, progress)))


def wide_shift_parameters(model):
    """The token-shift parameters --wide_shift_from_step holds: each Attention's k_shift_wide and q_shift."""
    return [
        weights
        for module in model.modules()
        if isinstance(module, Attention)
        for weights in (module.k_shift_wide, module.q_shift)
        if weights is not None
    ]


def build_optimizer(model, learning_rate):
    # Decay matrices (linear layers, embeddings), not norms and biases: the nanoGPT/minimind recipe.
    held = {id(weights) for weights in wide_shift_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    trained = [p for p in params if id(p) not in held]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]
    if held:
        groups.append({"params": [p for p in params if id(p) in held], "weight_decay": WEIGHT_DECAY, "wide_shift": True})
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def set_learning_rates(optimizer, step, total_steps, peak, warmup_steps, wide_shift_from_step, wide_shift_scale=1.0):
    """Sets every group's lr for optimizer step `step` (0-based) and returns the schedule's:
    the wide-shift group's is 0 until step wide_shift_from_step, then wide_shift_scale times it."""
    lr = learning_rate_at(step, total_steps, peak, warmup_steps)
    for group in optimizer.param_groups:
        if group.get("wide_shift"):
            group["lr"] = 0.0 if step < wide_shift_from_step else wide_shift_scale * lr
        else:
            group["lr"] = lr
    return lr


def optimizer_step(model, optimizer, scaler, grad_clip):
    """Clip (grad_clip > 0) the gradients of the parameters this step changes, step, and clear the gradients."""
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        # A held group's gradients would count in the norm and shrink everything else's step.
        held = {id(p) for group in optimizer.param_groups if group["lr"] == 0 for p in group["params"]}
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if id(p) not in held], grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
