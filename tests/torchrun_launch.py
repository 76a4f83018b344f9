"""Run a script of this repository under torchrun (torch.distributed.run), as a user would."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Only guards against a hang: each rank imports torch and transformers (10-50 s on a loaded 2-core machine).
TIMEOUT_S = 300


def torchrun(ranks, script, *args, input=None):
    """`torchrun --standalone --nproc_per_node ranks script args` from the repository root, `input` on
    its stdin (rank 0 reads it) -> CompletedProcess."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), script, *args]
    return subprocess.run(command, cwd=REPO_ROOT, input=input, capture_output=True, text=True, timeout=TIMEOUT_S)
