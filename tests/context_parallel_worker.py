"""One rank of a context-parallel test launch: tests/test_context_parallel.py forks N processes
that each run main(rank, world, port, out_dir, mode) (forked, they skip the imports' start-up).

    mode "check": every case of CASES against one process without context parallelism; writes
    OUT_DIR/rank{RANK}.json with each case's largest logit differences and whether greedy tokens agree.
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
GROUP_TIMEOUT_S = {"check": 60.0, "die": 8.0, "hang": 4.0}


def tiny_model(**overrides):
    """A 2-layer ANN model, window 16, blocks of 8, top 2, with token shift (random, nonzero weights)."""
    torch.manual_seed(0)
    config = MiniMindConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attn_impl="ann", ann_window=16, ann_block_size=BLOCK, ann_top_n=2, key_shift=2, query_shift=1, **overrides,
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
    """{case name: reference()} of every case: computed once before the fork, shared by the ranks."""
    with torch.no_grad():
        return {name: reference(tiny_model(**settings), prompt(length)) for name, (settings, length, _) in cases(world).items()}


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
