"""One rank of a context-parallel test launch: tests/test_context_parallel.py forks N processes
that each run main(rank, world, port, out_dir, mode) (forked, they skip the imports' start-up).

    mode "check": every case of CASES against one process without context parallelism; writes
    OUT_DIR/rank{RANK}.json with each case's largest logit differences and whether greedy tokens agree.
    mode "train": every case of train_cases against one process's loss and gradients; writes
    OUT_DIR/rank{RANK}.json with each case's relative loss and gradient differences.
    MODE "die" / "hang": rank 1 exits / sleeps after the prefill; the others decode and must fail
    with a ShardFailure (exit 3, its one line in OUT_DIR/failure{RANK}) within the group's timeout.
"""

import json
import os
import sys
import time

import torch

from model.config import MiniMindConfig
from model.context_parallel import ContextParallelLM, ShardFailure, join_group, split_by_blocks
from model.model import MiniMindForCausalLM

BLOCK = 8
DECODE_STEPS = 32
GROUP_TIMEOUT_S = {"check": 60.0, "train": 60.0, "die": 8.0, "hang": 4.0}


def tiny_model(**overrides):
    """A 2-layer ANN model, window 16, blocks of 8, top 2, with token shift (random, nonzero weights)."""
    torch.manual_seed(0)
    settings = {"ann_window": 16, "ann_block_size": BLOCK, "ann_top_n": 2, **overrides}
    config = MiniMindConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attn_impl="ann", key_shift=2, query_shift=1, **settings,
    )
    model = MiniMindForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for weights in (layer.self_attn.k_shift, layer.self_attn.k_shift_wide, layer.self_attn.q_shift):
                weights.normal_(0, 0.5)
    return model


def even_bounds(length, world):
    """Bounds that split positions evenly: boundaries inside blocks for most lengths."""
    return tuple(length * rank // world for rank in range(world)) + (length,)


def cases(world):
    """{name: (model settings, prompt length, shard bounds)} for one world size."""
    short = BLOCK * world - 3  # fewer blocks than ranks: with whole blocks per rank, the last ranks hold nothing
    return {
        "block_edges": ({}, 96, split_by_blocks(96, world, BLOCK)),
        "inside_blocks": ({}, 101, even_bounds(101, world)),
        "shorter_than_world_blocks": ({}, short, split_by_blocks(short, world, BLOCK)),
        "one_position_shards": ({}, 61, (0,) + tuple(range(41, 41 + world - 1)) + (61,)),
        "true_positions_mean": ({"ann_block_position": "true", "ann_block_summary": "mean"}, 101, even_bounds(101, world)),
        # Each rank searches HNSW graphs over its own blocks; at this size their recall is 1, so
        # the answer is the single process's exact one.
        "hnsw_per_shard": ({"ann_retrieval": "hnsw"}, 157, even_bounds(157, world)),
        "auto_per_shard": ({"ann_retrieval": "auto", "ann_auto_threshold": 6}, 157, even_bounds(157, world)),
    }


def reference(model, ids):
    """One process without context parallelism: prefill logits (1, s, vocab) and 32 greedy decode steps."""
    cache = model.new_cache()
    prefill = model(ids, cache=cache, use_cache=True).logits
    token, steps = prefill[:, -1:].argmax(-1), []
    for _ in range(DECODE_STEPS):
        steps.append(model(token, cache=cache, use_cache=True).logits)
        token = steps[-1][:, -1:].argmax(-1)
    return prefill, steps


def prompt(length):
    torch.manual_seed(1)
    return torch.randint(3, 64, (1, length))


def references(world):
    """{case name: reference()} of every case, always with exact retrieval: computed once before the
    fork, shared by the ranks."""
    with torch.no_grad():
        return {name: reference(tiny_model(**{**settings, "ann_retrieval": "exact"}), prompt(length))
                for name, (settings, length, _) in cases(world).items()}


TRAIN_SETTINGS = {"ann_window": 8, "ann_block_size": 4, "ann_top_n": 2}  # 37 positions: up to 7 candidate blocks
GRAD_FLOOR = 1e-6  # |gradient| scale below which a parameter's differences are taken as absolute


def train_cases(world):
    """{name: (prompt length, shard bounds)} for the training step, TRAIN_SETTINGS' blocks of 4."""
    last_holds_nothing = even_bounds(37, world - 1) + (37,) if world > 1 else (0, 37)
    return {"block_edges": (40, split_by_blocks(40, world, 4)), "inside_blocks": (37, even_bounds(37, world)),
            "last_rank_holds_nothing": (37, last_holds_nothing)}


def train_reference(ids, **settings):
    """One process without context parallelism: (mean next-token loss, {parameter name: gradient})."""
    model = tiny_model(**{**TRAIN_SETTINGS, **settings})
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    return float(loss.detach()), {name: parameter.grad for name, parameter in model.named_parameters()}


def train_references(world):
    """{case name: train_reference()} of every training case, computed before the fork."""
    return {name: train_reference(prompt(length)) for name, (length, _) in train_cases(world).items()}


def gradient_difference(grads, expected):
    """max over parameters of max |g - g_ref| / max(max |g_ref|, GRAD_FLOOR)."""
    return max(float((grads[name] - reference).abs().max()) / max(float(reference.abs().max()), GRAD_FLOOR)
               for name, reference in expected.items())


def train_case(group, length, bounds, expected):
    ids = prompt(length)
    expected_loss, expected_grads = expected
    model = tiny_model(**TRAIN_SETTINGS)
    sharded, bytes_before = ContextParallelLM(model, group, bounds), group.bytes_sent
    loss = sharded.train_step(ids[:, bounds[group.rank] : bounds[group.rank + 1]])
    grads = {name: parameter.grad for name, parameter in model.named_parameters()}
    return {"loss_diff": abs(loss - expected_loss) / abs(expected_loss), "grad_diff": gradient_difference(grads, expected_grads),
            "bounds": list(bounds), "bytes_sent": group.bytes_sent - bytes_before}


def check_case(group, settings, length, bounds, expected):
    ids = prompt(length)
    expected_prefill, expected_steps = expected
    sharded = ContextParallelLM(tiny_model(**settings), group, bounds)
    lo, hi = bounds[group.rank], bounds[group.rank + 1]
    prefill = sharded.prefill(ids[:, lo:hi])
    prefill_diff = float((prefill - expected_prefill[:, lo:hi]).abs().max()) if hi > lo else 0.0
    token, decode_diff, same_tokens = expected_prefill[:, -1:].argmax(-1), 0.0, True
    for expected in expected_steps:
        logits = sharded.decode(token)
        decode_diff = max(decode_diff, float((logits - expected).abs().max()))
        same_tokens &= bool((logits[:, -1].argmax(-1) == expected[:, -1].argmax(-1)).all())
        token = expected[:, -1:].argmax(-1)
    return {"prefill_diff": prefill_diff, "decode_diff": decode_diff, "same_tokens": same_tokens,
            "bounds": list(bounds), "bytes_sent": group.bytes_sent}


def main(rank, world, port, out_dir, mode, expected=None):
    """The rank's work (expected: references(world) for "check"); exits with 0, or 3 after a ShardFailure."""
    torch.set_num_threads(1)
    group = join_group(rank, world, f"tcp://127.0.0.1:{port}", GROUP_TIMEOUT_S[mode])
    if mode == "train":
        results = {name: train_case(group, *case, expected[name]) for name, case in train_cases(world).items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
            json.dump(results, file)
        sys.exit(0)
    with torch.no_grad():
        if mode == "check":
            results = {name: check_case(group, *case, expected[name]) for name, case in cases(world).items()}
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
                json.dump(results, file)
            sys.exit(0)
        ids = torch.randint(3, 64, (1, 64))
        bounds = split_by_blocks(64, world, BLOCK)
        sharded = ContextParallelLM(tiny_model(), group, bounds)
        sharded.prefill(ids[:, bounds[rank] : bounds[rank + 1]])
        if rank == 1:
            if mode == "die":
                os._exit(1)
            time.sleep(600)
        try:
            for _ in range(DECODE_STEPS):
                sharded.decode(ids[:, -1:])
        except ShardFailure as failure:
            with open(os.path.join(out_dir, f"failure{rank}"), "w") as file:
                file.write(str(failure))
            sys.exit(3)
        sys.exit(0)
