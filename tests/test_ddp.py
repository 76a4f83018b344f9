"""Multi-process training: torchrun --nproc_per_node 2 on CPU (gloo) against one process.

DDP tests: each launches `python -m torch.distributed.run` (torchrun) as a real subprocess, with its
rendezvous on 127.0.0.1 only. One process with --batch_size 4 and two with --batch_size 2 train on
the same global batches: micro-batch m of the epoch is samples [4m, 4m + 4) of the epoch's order in
both cases (rank r takes every second sample). Every document fills max_seq_len, so the mean of the
two ranks' per-token losses is the one-process mean and the two runs agree up to float rounding.

Which samples a run trained on is recorded by a wrapper around PretrainDataset.__getitem__ (in this
process with monkeypatch, in torchrun workers through a wrapper script), one log per rank.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from transformers import AutoTokenizer

from dataset.lm_dataset import PretrainDataset
from tests.test_trainer import PEOPLE, SMALL_MODEL, read_metrics, run_stage, write_jsonl
from trainer import train_pretrain

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

REPO_ROOT = Path(__file__).resolve().parent.parent
RELATIVE_TOLERANCE = 1e-5
# 48 documents, global batch 4, no accumulation: 12 optimizer steps per epoch, 24 in all.
TRAINING = ["--accumulation_steps", "1", "--epochs", "2", "--learning_rate", "2e-3", "--keep_checkpoints", "20"]
ONE_PROCESS, TWO_PROCESSES = ["--batch_size", "4"], ["--batch_size", "2"]
TOTAL_STEPS = 24
TORCHRUN_TIMEOUT_S = 120

# torchrun runs a file; this one logs every sample a rank reads, then is the pretrain script. It also
# leaves the worker's pid: torchrun starts each worker in a session of its own, so killing torchrun
# alone would leave the workers training on.
LOGGING_WRAPPER = f"""
import os, sys
sys.path.insert(0, {str(REPO_ROOT)!r})
from dataset.lm_dataset import PretrainDataset
from trainer import train_pretrain

log_dir, rank = os.environ["READ_LOG_DIR"], os.environ["RANK"]
with open(os.path.join(log_dir, "pid" + rank), "w") as f:
    f.write(str(os.getpid()))
log = open(os.path.join(log_dir, "rank" + rank), "a")
read_item = PretrainDataset.__getitem__

def logged_read(dataset, i):
    log.write(f"{{i}}\\n")
    log.flush()
    return read_item(dataset, i)

PretrainDataset.__getitem__ = logged_read
train_pretrain.main(train_pretrain.STAGE)
"""



@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    # Four sentences about four people: always longer than the 64 tokens of SMALL_MODEL's max_seq_len.
    texts = []
    for i in range(48):
        sentences = [f"{name} lives in {city}, the capital of {country}, and is {20 + 7 * i + k} years old."
                     for k, (name, city, country) in enumerate(PEOPLE[i % 3 : i % 3 + 4])]
        texts.append(" ".join(sentences))
    path = write_jsonl(tmp_path_factory.mktemp("data") / "pretrain.jsonl", [{"text": text} for text in texts])
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "model" / "tokenizer")
    assert min(len(tokenizer(text)["input_ids"]) for text in texts) >= 64
    return path


@contextlib.contextmanager
def reads_logged(reads):
    """Append the index of every sample read in this process to the list `reads`."""
    read_item = PretrainDataset.__getitem__

    def logged_read(dataset, i):
        reads.append(i)
        return read_item(dataset, i)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PretrainDataset, "__getitem__", logged_read)
        yield


def global_batches(reads_per_rank, batch_size):
    """The samples of each global micro-batch (sorted), from the reads of each rank; complete ones only."""
    per_rank = [[reads[i : i + batch_size] for i in range(0, len(reads) - batch_size + 1, batch_size)]
                for reads in reads_per_rank]
    count = min(len(batches) for batches in per_rank)
    return [sorted(sum((batches[m] for batches in per_rank), [])) for m in range(count)]


def rank_reads(log_dir):
    return [[int(line) for line in (log_dir / f"rank{rank}").read_text().split()] for rank in (0, 1)]


def start_torchrun(out_dir, data_path, log_dir, *flags):
    """torchrun with two CPU workers; stdout/stderr (unbuffered, rank 0's and torchrun's) to files."""
    log_dir.mkdir(parents=True, exist_ok=True)
    wrapper = log_dir / "train_pretrain_logged.py"
    wrapper.write_text(LOGGING_WRAPPER)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", str(wrapper),
        "--out_dir", str(out_dir), "--data_path", str(data_path), *SMALL_MODEL, "--log_interval", "1",
        "--device", "cpu", *TRAINING, *TWO_PROCESSES, *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
           "READ_LOG_DIR": str(log_dir)}
    with open(log_dir / "stdout", "w") as stdout, open(log_dir / "stderr", "w") as stderr:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr)


def kill_torchrun(process, log_dir):
    """kill -9 torchrun and its workers, and wait until the workers are gone."""
    process.kill()
    process.wait()
    workers = [int(path.read_text()) for path in log_dir.glob("pid*")]
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while any(is_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.01)


def is_alive(pid):
    try:  # an orphan killed in a container without an init that reaps stays a zombie
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_or_kill(process, log_dir, timeout):
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_torchrun(process, log_dir)
        pytest.fail(f"torchrun did not exit within {timeout} s (hang)")


def assert_losses_close(records, reference):
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for record, expected in zip(records, reference):
        assert record["tokens_seen"] == expected["tokens_seen"] and record["lr"] == pytest.approx(expected["lr"])
        assert record["loss"] == pytest.approx(expected["loss"], rel=RELATIVE_TOLERANCE), f"step {record['step']}"


def max_differences(records, reference):
    absolute = [abs(r["loss"] - e["loss"]) for r, e in zip(records, reference)]
    return max(absolute), max(a / abs(e["loss"]) for a, e in zip(absolute, reference))


@pytest.fixture(scope="module")
def reference(data_path, tmp_path_factory):
    """One process, uninterrupted, a checkpoint every 2 steps: (out_dir, metrics, global batches)."""
    out_dir, reads = tmp_path_factory.mktemp("reference"), []
    with reads_logged(reads):
        assert run_stage(train_pretrain, out_dir, data_path, *TRAINING, *ONE_PROCESS, "--save_interval", "2") == 0
    records = read_metrics(out_dir)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    return out_dir, records, global_batches([reads], 4)


def test_two_processes_match_one_and_only_rank_0_writes(reference, data_path, tmp_path):
    _, expected, expected_batches = reference
    out_dir, log_dir = tmp_path / "out", tmp_path / "logs"
    process = start_torchrun(out_dir, data_path, log_dir, "--save_interval", "10", "--keep_checkpoints", "2")
    code = wait_or_kill(process, log_dir, TORCHRUN_TIMEOUT_S)
    assert code == 0, (log_dir / "stderr").read_text()[-3000:]

    records = read_metrics(out_dir)
    assert_losses_close(records, expected)
    print("two vs one process, max |loss difference| (abs, rel): %.3g, %.3g" % max_differences(records, expected))
    assert global_batches(rank_reads(log_dir), 2) == expected_batches

    # Rank 1 writing too would leave duplicated metrics lines or a second set of files.
    assert sorted(path.name for path in out_dir.iterdir()) == ["checkpoints", "loss.png", "metrics.jsonl", "model"]
    assert sorted(path.name for path in log_dir.glob("pid*")) == ["pid0", "pid1"]
    assert not any(is_alive(int(path.read_text())) for path in log_dir.glob("pid*"))
    assert sorted(path.name for path in (out_dir / "checkpoints").iterdir()) == ["step_0000020.pt", "step_0000024.pt"]
    assert "dataset report" in (log_dir / "stdout").read_text()


def test_resume_when_the_number_of_processes_changes(reference, data_path, tmp_path):
    reference_dir, expected, expected_batches = reference
    out_dir = tmp_path / "out"
    (out_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(reference_dir / "checkpoints" / "step_0000004.pt", out_dir / "checkpoints")
    write_jsonl(out_dir / "metrics.jsonl", expected[:4])

    # 1 -> 2 processes: resume one process's step-4 checkpoint with torchrun, kill -9 it after step 9.
    log_dir = tmp_path / "logs"
    process = start_torchrun(out_dir, data_path, log_dir, "--save_interval", "2", "--from_resume", "1")
    deadline = time.time() + TORCHRUN_TIMEOUT_S
    while time.time() < deadline and process.poll() is None:
        if len((out_dir / "metrics.jsonl").read_text().splitlines()) >= 9:
            break
        time.sleep(0.01)
    kill_torchrun(process, log_dir)
    stdout = (log_dir / "stdout").read_text()
    assert "resumed from" in stdout and "step_0000004.pt" in stdout
    killed_at = len(read_metrics(out_dir))
    assert 9 <= killed_at < TOTAL_STEPS, "the run ended before it was killed"
    assert_losses_close(read_metrics(out_dir), expected[:killed_at])
    saved_step = int(max((out_dir / "checkpoints").glob("step_*.pt")).stem.removeprefix("step_"))
    assert saved_step >= 8
    two_process_batches = global_batches(rank_reads(log_dir), 2)
    assert two_process_batches[: saved_step - 4] == expected_batches[4:saved_step]

    # 2 -> 1 process, same global batch: the rest of the run is the uninterrupted one.
    same_batch_dir = tmp_path / "same_global_batch"
    shutil.copytree(out_dir, same_batch_dir)
    reads = []
    with reads_logged(reads):
        assert run_stage(train_pretrain, same_batch_dir, data_path, *TRAINING, *ONE_PROCESS,
                         "--save_interval", "2", "--from_resume", "1") == 0
    records = read_metrics(same_batch_dir)
    assert_losses_close(records, expected)
    print(f"1 -> 2 (resumed at step 4) -> 1 process (resumed at step {saved_step}), steps 5-{TOTAL_STEPS}: "
          "max |loss difference| (abs, rel): %.3g, %.3g" % max_differences(records[4:], expected[4:]))
    # Together the three runs trained on every sample of the two epochs exactly once.
    assert global_batches([reads], 4) == expected_batches[saved_step:]

    # 2 -> 1 process keeping --batch_size 2 halves the global batch: the data still continues exactly
    # at the first sample not yet trained on (the position is a count of samples, not of batches).
    reads = []
    with reads_logged(reads):
        assert run_stage(train_pretrain, out_dir, data_path, *TRAINING, *TWO_PROCESSES,
                         "--save_interval", "100", "--from_resume", "1") == 0
    assert len(reads) == 4 * (TOTAL_STEPS - saved_step)
    assert global_batches([reads], 4) == expected_batches[saved_step:]
