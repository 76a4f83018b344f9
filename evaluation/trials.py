"""One greedy answer to a long prompt, timed, and the process's peak memory: what every retrieval
evaluation (scripts/eval_passkey.py, scripts/eval_needles.py) measures per trial. Under a torchrun
launch the prompt is sharded over the ranks (model/context_parallel.py), every rank running the
same trials."""

import os
import random
import resource
import sys
import time

import numpy as np
import torch

from common.cli import UsageError
from model.context_parallel import join_launch_group, shard_prompt


def trial_rng(seed, task, lang, length, index):
    """A needle trial's own generator: its prompt does not depend on which other trials run."""
    return random.Random(f"{seed}/{task}/{lang}/{length}/{index}")


def spread_depths(trials):
    """`trials` needle depths spread evenly over 0..1, both ends included."""
    return [float(depth) for depth in np.linspace(0.0, 1.0, trials)]


def join_trial_group(config, path):
    """Under torchrun: the context-parallel group that every trial is sharded over (only rank 0 keeps
    its stdout: the ranks run the same trials); None in a plain process or a launch of one.
    UsageError for a model whose attention cannot be sharded."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return None
    if config.attn_impl != "ann":
        raise UsageError(f"{path} has {config.attn_impl} attention; a torchrun launch shards ANN attention only")
    group = join_launch_group()
    if group.rank:
        sys.stdout = open(os.devnull, "w")
    return group


def run_trial(model, tokenizer, prompt_ids, prefill_chunk, max_new_tokens, group=None):
    """Greedy continuation of the prompt -> (text, prefill seconds, total seconds).

    The prompt goes through model.stream_generate, which fills the KV cache prefill_chunk tokens at a
    time (0 or None: all at once), so activations never exceed one chunk's. The prefill time is the
    time to the first new token; generation stops at a document or chat end. With a context-parallel
    group (ShardGroup), each rank prefills its shard of whole blocks in one pass (prefill_chunk
    unused) and the answer is the same on every rank.
    """
    end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    if group is not None:
        start = time.perf_counter()
        sharded, local_ids = shard_prompt(model, group, prompt_ids)
        answer_ids, prefill_s = sharded.greedy(local_ids, max_new_tokens, end_ids)
        return tokenizer.decode(answer_ids, skip_special_tokens=True), prefill_s, time.perf_counter() - start
    input_ids = torch.tensor([prompt_ids], device=model.device)
    answer_ids, prefill_s = [], None
    start = time.perf_counter()
    for token in model.stream_generate(
        input_ids, max_new_tokens=max_new_tokens, temperature=0.0, prefill_chunk=prefill_chunk or None
    ):
        if prefill_s is None:
            prefill_s = time.perf_counter() - start
        if int(token) in end_ids:
            break
        answer_ids.append(int(token))
    total_s = time.perf_counter() - start
    return tokenizer.decode(answer_ids, skip_special_tokens=True), prefill_s, total_s


def peak_rss_mb():
    """The process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def ranks_peak_rss_mb(group):
    """[peak_rss_mb()] of every rank of a context-parallel group, in rank order (this process alone
    without one); every rank must call it."""
    if group is None:
        return [round(peak_rss_mb(), 1)]
    return [round(float(value), 1) for value in group.raw_all_gather(torch.tensor([peak_rss_mb()], dtype=torch.float64)).flatten()]
