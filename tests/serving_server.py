"""The tests' server: a tiny ANN model saved to a folder and scripts/serve_openai_api.py serving it.

One server serves every test module of a session (`shared_server`): its start-up, the imports of
a fresh interpreter, is most of the serving tests' time. It has an API key, a 1024-token context
and 16-token prefill chunks, so prompts are prefilled in several steps and retrieve blocks.

The model is hidden 64, 2 layers, with a 16-token window, 8-token blocks and top 2, so prompts of
40+ tokens retrieve blocks; its weights are drawn wide (std 0.3) so greedy answers vary from token
to token, as in tests/test_generation.py.
"""

import atexit
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from model import MiniMindConfig, MiniMindForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 180  # imports alone take half a minute on a loaded 2-core machine
API_KEY = "test-key"
CONTEXT = 1024
MAX_TOKENS_CAP = 1000
MAX_BODY = 65536
SHARED = {}


def tiny_model(context):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=6400, max_position_embeddings=context, attn_impl="ann", ann_window=16,
                            ann_block_size=8, ann_top_n=2)
    model = MiniMindForCausalLM(config).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(std=0.3)
    return model


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A running server process; `url` is its base address."""

    def __init__(self, folder, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "scripts/serve_openai_api.py", "--load", str(folder), "--port", str(self.port),
                   "--threads", "1", *flags]
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        deadline = time.monotonic() + STARTUP_S
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self.process.stdout.read()[-3000:]}")
            time.sleep(0.2)

    def healthy(self):
        try:
            return self.health()["status"] == "ok"
        except (urllib.error.URLError, ConnectionError):
            return False

    def health(self, timeout=5):
        with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as response:
            return json.loads(response.read())

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve_tiny_model(folder, context, *flags):
    """Save the tiny model to folder and start a server on it -> (Server, the model in this process)."""
    model = tiny_model(context)
    model.save_pretrained(folder)
    return Server(folder, *flags), model


def shared_server(tmp_path_factory):
    """The session's server, started on first use and stopped when the session's process exits -> (Server, model)."""
    if not SHARED:
        server, model = serve_tiny_model(tmp_path_factory.mktemp("served") / "tiny", CONTEXT, "--api_key", API_KEY,
                                         "--prefill_chunk", "16", "--max_tokens_cap", str(MAX_TOKENS_CAP),
                                         "--max_body_mb", str(MAX_BODY / 2**20))
        atexit.register(server.stop)
        SHARED.update(server=server, model=model)
    return SHARED["server"], SHARED["model"]
