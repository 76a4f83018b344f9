"""Find and load a trained model with its tokenizer: the --load argument every evaluation script takes.

A --load is a saved model folder (save_pretrained), an out dir (its model/ folder, else its newest
checkpoint) or a checkpoint .pt written by the trainers. Checkpoints are read with
torch.load(weights_only=True): tensors, plain containers and the numpy RNG state the trainer saves
are all they may hold, so a crafted file cannot run code. Attention settings change no weights,
so the attention and retrieval of any model may be overridden at load time.
"""

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from common.cli import UsageError
from model.config import BLOCK_SUMMARIES, MiniMindConfig
from model.model import MiniMindForCausalLM
from trainer.checkpoints import TRAINING_ARGS_FILE, list_checkpoints

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TOKENIZER = REPO_ROOT / "model" / "tokenizer"
DEFAULT_MODELS = (Path("out/sft/model"), Path("out/pretrain/model"))


def check_device(device):
    """A UsageError when `device` asks for CUDA on a machine without it."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} requested but CUDA is not available")


def add_run_arguments(parser):
    """The evaluation programs' shared options: --threads, --device and --json."""
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write results here, and a plot to the same path with .png")


def apply_run_arguments(args):
    """Check add_run_arguments' options (a UsageError when one is wrong) and set torch's threads."""
    if args.threads is not None and args.threads <= 0:
        raise UsageError(f"--threads must be positive, got {args.threads}")
    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)


HNSW_OVERRIDES = {
    "hnsw_m": "HNSW links per node",
    "hnsw_ef_construction": "HNSW build breadth",
    "hnsw_ef_search": "HNSW search breadth",
    "hnsw_keys_per_head": "keys each query head asks a graph over keys for ('keys' selection with hnsw)",
}


def add_attention_overrides(parser):
    """Selection settings, which change no weights, so an ANN model may be evaluated with others than
    it was trained with: --block_summary, --top_n, --retrieval_layers, --logn_length and the HNSW
    settings, named as the trainers name them."""
    parser.add_argument("--block_summary", choices=BLOCK_SUMMARIES, default=None,
                        help="how blocks are scored for retrieval (default: the model's)")
    parser.add_argument("--top_n", type=int, default=None, help="blocks each query retrieves (default: the model's)")
    parser.add_argument("--retrieval_layers", type=int, nargs="*", default=None,
                        help="the decoder layers that retrieve; the others attend to their window only "
                             "(default: the model's)")
    parser.add_argument("--logn_length", type=int, default=None,
                        help="scale a retrieving layer's queries beyond this position by ln(t+1)/ln(L) (log-n "
                             "attention, usually the training length; default: the model's)")
    for name, what in HNSW_OVERRIDES.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=f"{what} (default: the model's)")


def attention_overrides(args):
    """{config name: value} of the add_attention_overrides options given."""
    named = {"ann_block_summary": args.block_summary, "ann_top_n": args.top_n,
             "ann_retrieval_layers": args.retrieval_layers,
             "ann_logn_length": args.logn_length,
             **{name: getattr(args, name) for name in HNSW_OVERRIDES}}
    return {name: value for name, value in named.items() if value is not None}


def resolve_load_path(load):
    """The saved model folder or checkpoint file that --load names (None: the default models)."""
    if load is None:
        for folder in DEFAULT_MODELS:
            if (folder / "config.json").is_file():
                return folder
        raise UsageError(f"no trained model found ({' or '.join(map(str, DEFAULT_MODELS))}); train one "
                         "(trainer/train_pretrain.py, trainer/train_full_sft.py) or pass --load")
    path = Path(load)
    if path.is_file():
        return path
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file():
        return path / "model"
    checkpoints = list_checkpoints(path)
    if checkpoints:
        return checkpoints[0]
    raise UsageError(f"--load {load}: not a model folder, an out dir or a checkpoint file")


def numpy_rng_globals():
    """What unpickling np.random.get_state() needs (a uint32 array), which every training
    checkpoint holds once per rank: the array's rebuild function, its classes and its dtype's class."""
    key = np.random.get_state()[1]
    rebuild = key.__reduce__()[0]
    return [rebuild, np.ndarray, np.dtype, type(key.dtype)]


def read_checkpoint(path):
    """The payload of a training checkpoint, read without running any code stored in it."""
    with torch.serialization.safe_globals(numpy_rng_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def config_from_checkpoint(payload, path):
    """The model config the checkpoint was trained with (stored next to the weights)."""
    if not isinstance(payload, dict) or "model" not in payload or "config" not in payload:
        raise UsageError(f"--load {path}: not a training checkpoint (no 'model' and 'config' entries)")
    try:
        return MiniMindConfig.from_dict(payload["config"])
    except ValueError as error:
        raise UsageError(f"--load {path}: invalid model config in the checkpoint ({error})") from None


def tokenizer_folder(folder):
    """`folder` when it holds a tokenizer, else the shipped one."""
    folder = Path(folder)
    return folder if (folder / "tokenizer.json").is_file() else SHIPPED_TOKENIZER


def load_model(path, attn, retrieval, device, overrides=None):
    """(model in eval mode, tokenizer) from a model folder or a checkpoint, with attention overrides
    (None keeps the model's; `overrides` maps more config names to values)."""
    try:
        if path.is_dir():
            config = MiniMindConfig.from_pretrained(path)
            tokenizer_dir = tokenizer_folder(path)
        else:
            payload = read_checkpoint(path)
            config = config_from_checkpoint(payload, path)
            tokenizer_dir = tokenizer_folder(payload["args"].get("tokenizer_path", ""))
        if attn is not None:
            config.attn_impl = attn
        if retrieval is not None:
            config.ann_retrieval = retrieval
        for name, value in (overrides or {}).items():
            setattr(config, name, value)
        config.validate_settings()
        if path.is_dir():
            model = MiniMindForCausalLM.from_pretrained(path, config=config)
        else:
            model = MiniMindForCausalLM(config)
            model.load_state_dict(payload["model"])
    except UsageError:
        raise
    except Exception as error:  # unreadable file, wrong format, shapes that do not match the config
        raise UsageError(f"--load {path}: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return model.to(device).eval(), tokenizer


def training_seed(path):
    """The seed the model at `path` (a model folder or a checkpoint) was trained with; None when
    nothing records it (a folder saved by other code)."""
    if path.is_dir():
        args_path = path / TRAINING_ARGS_FILE
        args = json.loads(args_path.read_text(encoding="utf-8")) if args_path.is_file() else {}
    else:
        args = read_checkpoint(path).get("args", {})
    return args.get("seed")
