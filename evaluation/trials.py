"""One greedy answer to a long prompt, timed, and the process's peak memory: what every retrieval
evaluation (scripts/eval_passkey.py, scripts/eval_needles.py) measures per trial."""

import resource
import time

import numpy as np
import torch


def spread_depths(trials):
    """`trials` needle depths spread evenly over 0..1, both ends included."""
    return [float(depth) for depth in np.linspace(0.0, 1.0, trials)]


def run_trial(model, tokenizer, prompt_ids, prefill_chunk, max_new_tokens):
    """Greedy continuation of the prompt -> (text, prefill seconds, total seconds).

    The prompt goes through model.stream_generate, which fills the KV cache prefill_chunk tokens at a
    time (0 or None: all at once), so activations never exceed one chunk's. The prefill time is the
    time to the first new token; generation stops at a document or chat end.
    """
    input_ids = torch.tensor([prompt_ids], device=model.device)
    end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
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
