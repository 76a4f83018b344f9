"""Serve a trained MiniMind over an OpenAI-compatible HTTP API, with a chat page at /.

    python scripts/serve_openai_api.py --load out/sft/model                 # http://127.0.0.1:8000/
    python scripts/serve_openai_api.py --load out/long_ann --cache_mb 4096 --max_active 4
    python scripts/serve_openai_api.py --host 0.0.0.0 --api_key "$KEY"     # reachable from other machines

Endpoints: GET /v1/models, POST /v1/chat/completions and /v1/completions (streaming or not),
GET /health, and the chat page at GET /. The model loads once (--load as in
evaluation/loading.py); one engine thread runs every request, a step of each in turn
(serving/engine.py), and keeps finished conversations' caches for --cache_mb MB so a follow-up
turn prefills only its new tokens. It listens on 127.0.0.1 unless --host says otherwise; with
--api_key every /v1/ request needs `Authorization: Bearer KEY`.
Exit codes: 0 stopped, 2 bad arguments or nothing loadable.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import uvicorn
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from common.cpu_memory import retain_freed_memory
from evaluation.loading import check_device, load_model, resolve_load_path
from model.config import ATTN_IMPLS, RETRIEVERS
from serving.engine import Engine
from serving.openai_api import create_app
from serving.prefix_cache import PrefixCache
from serving.validation import Limits


def parse_args(argv=None):
    p = OneLineParser(description="MiniMind OpenAI-compatible server")
    p.add_argument("--load", default=None, help="model folder, out dir or checkpoint .pt (default out/sft/model, "
                   "else out/pretrain/model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", default=None, help="require Authorization: Bearer API_KEY on /v1/ requests")
    p.add_argument("--model_name", default=None, help="the model id clients see (default: the --load folder name)")
    p.add_argument("--max_context", type=int, default=None, help="prompt + answer tokens "
                   "(default: the model's max_position_embeddings)")
    p.add_argument("--max_tokens_cap", type=int, default=2048, help="the largest max_tokens a request may ask for")
    p.add_argument("--max_body_mb", type=float, default=8.0, help="largest request body")
    p.add_argument("--cache_mb", type=float, default=2048.0, help="bytes of conversation caches kept between "
                   "requests (0: no prefix cache)")
    p.add_argument("--max_active", type=int, default=8, help="requests generating at once (more wait)")
    p.add_argument("--prefill_chunk", type=int, default=512, help="prompt tokens per prefill step")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--attn", choices=ATTN_IMPLS, default=None, help="override the model's attention")
    p.add_argument("--retrieval", choices=RETRIEVERS, default=None, help="override the ANN block retrieval")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def validate_args(args):
    for name in ("max_tokens_cap", "max_active", "prefill_chunk", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if args.cache_mb < 0 or args.max_body_mb <= 0:
        raise UsageError("--cache_mb must be >= 0 and --max_body_mb > 0")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api_key is empty")
    check_device(args.device)


def main(argv=None):
    transformers_logging.disable_progress_bar()
    retain_freed_memory()
    try:
        args = parse_args(argv)
        validate_args(args)
        path = resolve_load_path(args.load)
        model, tokenizer = load_model(path, args.attn, args.retrieval, torch.device(args.device))
        positions = model.config.max_position_embeddings
        context = positions if args.max_context is None else args.max_context
        if not 1 < context <= positions:
            raise UsageError(f"--max_context must be in 2..{positions} (the model's positions), got {context}")
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_name = args.model_name or path.resolve().name
    engine = Engine(model, tokenizer, PrefixCache(int(args.cache_mb * 2**20)), args.max_active,
                    args.prefill_chunk).start()
    limits = Limits(context=context, max_tokens_cap=args.max_tokens_cap)
    app = create_app(engine, tokenizer, limits, model_name, args.api_key, int(args.max_body_mb * 2**20))
    print(f"serving {model_name} ({path}) on http://{args.host}:{args.port}/ (context {context}, "
          f"cache {args.cache_mb:g} MB)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
