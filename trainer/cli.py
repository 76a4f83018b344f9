"""The trainer's command line: a stage's defaults, its flags, and every check made before data is read.

Each check raises UsageError with a one-line message; trainer/loop.py's main turns it into exit code 2.
"""

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import UsageError
from model.config import MAX_TOKEN_SHIFT, MiniMindConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
# Autocast dtypes on CUDA (keys of common.cli.DTYPES); float64 is no training dtype.
TRAINING_DTYPES = ("float32", "bfloat16", "float16")


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
    p.add_argument("--dtype", choices=TRAINING_DTYPES, default="bfloat16", help="autocast dtype on CUDA; CPU uses fp32")
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
                   help="previous tokens each key mixes in (smeared keys, see model/attention.py); default 0")
    p.add_argument("--query_shift", type=int, choices=range(MAX_TOKEN_SHIFT + 1), default=None,
                   help="previous tokens each query mixes in; default 0")
    p.add_argument("--wide_shift_from_step", type=int, default=0,
                   help="hold the token shift beyond a key's first previous token (a key's second, every "
                        "query's) fixed until this optimizer step; a new model's is zero, so with --key_shift 2 "
                        "it first trains as with --key_shift 1")
    p.add_argument("--wide_shift_lr_scale", type=float, default=1.0,
                   help="the held token shift's learning rate, once it trains, as a multiple of the schedule's "
                        "(its weights start at zero, so at a low rate they stay near it)")
    p.add_argument("--attn", default=None, help="ann | dense (default ann, or the --from_weight model's)")
    p.add_argument("--ann_window", type=int, default=None)
    p.add_argument("--ann_block_size", type=int, default=None)
    p.add_argument("--ann_top_n", type=int, default=None)
    p.add_argument("--ann_retrieval_layers", type=int, nargs="*", default=None,
                   help="the decoder layers that retrieve blocks (default every layer); the others attend to "
                        "their window only")
    p.add_argument("--ann_logn_length", type=int, default=None,
                   help="saved with the model: beyond this position a retrieving layer's queries are scaled by "
                        "ln(t+1)/ln(L) (log-n attention; usually the training length); default off")
    p.add_argument("--ann_batch_distractors", action="store_true", default=None,
                   help="training: a retrieving layer's queries also select among the other rows' blocks of the "
                        "batch (cross-batch distractors), so the copy trains against more candidates than one "
                        "sequence holds; saved with the model, it changes nothing outside training")
    p.add_argument("--ann_distractor_memory", type=int, default=None,
                   help="training, with --ann_batch_distractors: the complete blocks of this many earlier batches "
                        "stay (detached) as further distractor candidates; kept in checkpoints; default 0")
    p.add_argument("--ann_distractor_blocks", type=int, default=None,
                   help="training, with --ann_batch_distractors: a query's top_n blocks come from its own row "
                        "alone and this many of the best foreign blocks are attended on top (0: all compete "
                        "for top_n); default 0")
    p.add_argument("--ann_retrieval", default=None, help="exact | hnsw | auto")
    p.add_argument("--ann_block_position", default=None, help="capped | true: where retrieved keys sit for RoPE")
    p.add_argument("--ann_block_summary", default=None, help="bounds | mean | keys: how a block is scored for retrieval")
    p.add_argument("--hnsw_ef_search", type=int, default=None,
                   help="HNSW search breadth saved with the model (used when it retrieves with hnsw); default 64")
    p.add_argument("--hnsw_m", type=int, default=None, help="HNSW links per node saved with the model; default 32")
    p.add_argument("--hnsw_ef_construction", type=int, default=None, help="HNSW build breadth saved with the model; default 200")
    p.add_argument("--hnsw_keys_per_head", type=int, default=None,
                   help="keys each query head asks a graph over keys for ('keys' selection with hnsw); default 64")
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
    if not (math.isfinite(args.wide_shift_lr_scale) and args.wide_shift_lr_scale > 0):
        raise UsageError(f"--wide_shift_lr_scale must be a positive number, got {args.wide_shift_lr_scale}")
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
        ann_retrieval_layers=args.ann_retrieval_layers,
        ann_logn_length=args.ann_logn_length,
        ann_batch_distractors=args.ann_batch_distractors,
        ann_distractor_memory=args.ann_distractor_memory,
        ann_distractor_blocks=args.ann_distractor_blocks,
        ann_retrieval=args.ann_retrieval,
        ann_block_position=args.ann_block_position,
        ann_block_summary=args.ann_block_summary,
        hnsw_ef_search=args.hnsw_ef_search,
        hnsw_m=args.hnsw_m,
        hnsw_ef_construction=args.hnsw_ef_construction,
        hnsw_keys_per_head=args.hnsw_keys_per_head,
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


def validate_args_for_model(args, config):
    """The checks that need the model config as well as the flags."""
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
