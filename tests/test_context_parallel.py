"""Context parallelism (model/context_parallel.py) on CPU with gloo: real worker processes.

One launch per world size runs every case of tests/context_parallel_worker.py, forked from this
process (a fresh interpreter would spend most of the time importing), and each test reads which
cases failed. Every launch is guarded by a timeout.
"""

import json
import multiprocessing
import socket
import time

import pytest
import torch

from model import MiniMindConfig
from model.context_parallel import Partial, ShardedAttention, ShardGroup, global_top_n, local_top_n, merge_partials
from tests import context_parallel_worker as worker

TOLERANCE = 1e-5
LAUNCH_TIMEOUT_S = 150


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(world, mode, out_dir, expected=None):
    """Fork `world` worker processes (no second start-up of torch and transformers) -> processes."""
    port = free_port()
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=worker.main, args=(rank, world, port, str(out_dir), mode, expected)) for rank in range(world)]
    for process in processes:
        process.start()
    return processes


def wait_all(processes, timeout):
    """Exit codes, None for a process still running at the deadline (then killed)."""
    deadline = time.time() + timeout
    codes = []
    for process in processes:
        process.join(timeout=max(0.1, deadline - time.time()))
        codes.append(process.exitcode)
    for process, code in zip(processes, codes):
        if code is None:
            process.kill()
            process.join()
    return codes


def failed_cases(out_dir, world, passes):
    """["rank R case {result}"] of every case in the ranks' rank{R}.json for which passes(result) is false."""
    return [f"rank {rank} {name} {result}" for rank in range(world)
            for name, result in json.loads((out_dir / f"rank{rank}.json").read_text()).items() if not passes(result)]


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda world: f"{world}_ranks")
def test_sharded_prefill_and_decode_match_one_process(world, tmp_path):
    codes = wait_all(launch(world, "check", tmp_path, worker.references(world)), LAUNCH_TIMEOUT_S)
    assert codes == [0] * world, f"exit codes {codes} (None: killed at the {LAUNCH_TIMEOUT_S} s deadline)"
    failures = failed_cases(tmp_path, world, lambda result: result["prefill_diff"] <= TOLERANCE
                            and result["decode_diff"] <= TOLERANCE and result["same_tokens"])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda world: f"{world}_ranks")
def test_sharded_training_step_matches_one_process_loss_and_gradients(world, tmp_path):
    """Relative differences: |loss - ref| / |ref|, and per parameter max |g - g_ref| / max(max |g_ref|,
    worker.GRAD_FLOOR), the largest over parameters; every rank against the same reference."""
    codes = wait_all(launch(world, "train", tmp_path, worker.train_references(world)), LAUNCH_TIMEOUT_S)
    assert codes == [0] * world, f"exit codes {codes} (None: killed at the {LAUNCH_TIMEOUT_S} s deadline)"
    failures = failed_cases(tmp_path, world, lambda result: result["loss_diff"] <= TOLERANCE and result["grad_diff"] <= TOLERANCE)
    assert not failures, "\n".join(failures)


def test_retrieval_changes_the_training_gradients_beyond_the_tolerance():
    """The training cases exercise retrieval: a sharded step that lost the selected blocks on some
    rank (or merged them wrongly) would miss the reference by far more than TOLERANCE."""
    ids = worker.prompt(37)
    loss, grads = worker.train_reference(ids)
    window_only_loss, window_only_grads = worker.train_reference(ids, ann_top_n=0)
    assert worker.gradient_difference(window_only_grads, grads) > 1000 * TOLERANCE
    assert abs(window_only_loss - loss) / abs(loss) > 10 * TOLERANCE


@pytest.mark.parametrize("mode", ["die", "hang"], ids=["a_rank_dies", "a_rank_hangs"])
def test_a_lost_rank_makes_the_others_fail_clearly_within_the_timeout(mode, tmp_path):
    processes = launch(2, mode, tmp_path)
    code = wait_all(processes[:1], LAUNCH_TIMEOUT_S)[0]
    wait_all(processes[1:], 0.1)  # the hung rank is killed here
    assert code == 3, f"rank 0 exit code {code} (None: still running after {LAUNCH_TIMEOUT_S} s)"
    assert (tmp_path / "failure0").read_text().startswith("context parallel rank 0/2: ")


def test_tied_scores_go_to_the_lower_block_id_whatever_the_sharding():
    scores = torch.tensor([[[[1.0, 3.0, 3.0, 2.0, 3.0, 0.5]]]])  # (b, g, T, m)
    for cut in range(7):
        parts = [scores[..., :cut], scores[..., cut:]]
        local = [local_top_n(part, 2, first) for part, first in zip(parts, (0, cut))]
        ids, valid = global_top_n(torch.stack([s for s, _ in local]), torch.stack([i for _, i in local]), 2)
        assert ids.flatten().tolist() == [1, 2] and bool(valid.all()), f"cut at {cut}"


def test_one_rank_merge_is_the_softmax():
    torch.manual_seed(0)
    logits, values = torch.randn(3, 5), torch.randn(5, 4)
    top = logits.amax(-1)
    weights = torch.exp(logits - top[:, None])
    out = merge_partials(ShardGroup(), Partial(top, weights.sum(-1), weights @ values), None)
    torch.testing.assert_close(out, logits.softmax(-1) @ values, rtol=TOLERANCE, atol=TOLERANCE)


def test_keys_summaries_are_refused_with_the_reason():
    """"keys" scores every key of a block, which the ranks' merge of per-block summary scores does
    not carry: a sharded layer refuses it at construction."""
    config = MiniMindConfig(hidden_size=32, num_attention_heads=4, attn_impl="ann", ann_block_summary="keys")
    with pytest.raises(ValueError, match="'keys' is single-process only"):
        ShardedAttention(config, group=None, shards=None)
