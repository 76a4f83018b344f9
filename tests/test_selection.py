"""evaluation/selection.py: where a query ranks a target block by summary, best key and attention mass."""

import math
from pathlib import Path

import torch
from transformers import AutoTokenizer

from evaluation.selection import block_scores, bounds_must_score, hnsw_key_scores, target_ranks, value_position
from model import MiniMindConfig

TOKENIZER = Path(__file__).resolve().parent.parent / "model" / "tokenizer_prose"


def planted_keys():
    """Two kv heads of one query head each, d 2, blocks of 2, window 2, query (1, 1) at position 8:
    candidate blocks 0..3. Block 1 holds one key along the query (q . k = 2) and a zero key; the
    other blocks hold (2, -2) and (-2, 2), which the query scores 0 each, but whose channel-wise
    [max, min] bound scores 4."""
    spread = torch.tensor([[2.0, -2.0], [-2.0, 2.0]])
    blocks = [spread, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), spread, spread, spread]
    keys = torch.cat(blocks)[None].expand(2, -1, -1).contiguous()  # (g, t, d)
    queries = torch.ones(2, 2)  # (h, d)
    return queries, keys


def test_bounds_ranks_the_needle_below_loose_blocks_where_the_best_key_ranks_it_first():
    queries, keys = planted_keys()
    scores, _ = block_scores(queries, keys, 8, window=2, block_size=2, summary="bounds")
    ranks = target_ranks(scores, 2, block_size=2)
    assert scores["summary"].shape[1] == 4
    assert ranks["summary"].tolist() == [4, 4]  # three blocks bound higher
    assert ranks["max_logit"].tolist() == [1, 1] and ranks["mass"].tolist() == [1, 1]
    ranks = target_ranks(block_scores(queries, keys, 8, 2, 2, "keys")[0], 2, block_size=2)
    assert ranks["summary"].tolist() == [1, 1]


def test_scores_follow_their_definitions():
    queries, keys = planted_keys()
    scores, _ = block_scores(queries, keys, 8, 2, 2, "keys")
    assert torch.allclose(scores["summary"], scores["max_logit"] * math.sqrt(2))  # the same ranking, unscaled
    expected_mass = math.log(math.exp(2 / math.sqrt(2)) + 1.0)
    assert abs(float(scores["mass"][0, 1]) - expected_mass) < 1e-6


def test_a_target_in_the_window_is_no_candidate():
    queries, keys = planted_keys()
    scores, _ = block_scores(queries, keys, 8, window=2, block_size=2, summary="bounds")
    assert target_ranks(scores, 8, block_size=2) is None and scores["summary"].shape[1] == 4


def test_value_position_finds_the_numbers_first_token():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    for text, value in [("The special magic number for amber falcon is 4821937. And then", 4821937),
                        ("金色猎鹰的特别魔法数字是95512。曹操", 95512)]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        start = value_position(tokenizer, ids, value)
        assert tokenizer.decode(ids[start:]).strip().startswith(str(value))
        assert not tokenizer.decode(ids[:start]).strip().endswith(str(value)[0])
        assert value_position(tokenizer, ids, 1234567) is None


def test_hnsw_key_scores_equal_the_best_keys_when_every_key_is_found():
    generator = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(4, 8, generator=generator), torch.randn(2, 64, 8, generator=generator)
    config = MiniMindConfig(hnsw_m=8, hnsw_ef_construction=32, hnsw_ef_search=64, hnsw_keys_per_head=64)
    scores, building = hnsw_key_scores(queries, keys, 8, config)
    exact = block_scores(queries, keys, 72, 16, 8, "keys")[0]["summary"]  # (72 - 16) // 8 + 1 = 8 blocks
    assert torch.allclose(scores.float(), exact, atol=1e-4) and building > 0


def test_hnsw_key_scores_never_offer_a_block_whose_keys_no_head_found():
    """One key per head: the blocks holding the keys the heads found score their best keys, every
    other block -inf (the model's selection would never see it)."""
    queries, keys = planted_keys()
    config = MiniMindConfig(hnsw_m=4, hnsw_ef_construction=16, hnsw_ef_search=16, hnsw_keys_per_head=1)
    scores, _ = hnsw_key_scores(queries, keys[:, :8], 2, config)
    exact = block_scores(queries, keys[:, :8], 8, 2, 2, "keys")[0]["summary"]
    found = scores > float("-inf")
    assert found.sum(dim=1).tolist() == [1] * scores.shape[0]
    assert torch.allclose(scores[found].float(), exact[found])
    assert (exact.argmax(dim=1) == found.float().argmax(dim=1)).all()


def test_bounds_must_score_counts_the_blocks_a_pruned_search_cannot_skip():
    def must_score(keys, top_n):
        scores, _ = block_scores(queries, keys, 8, 2, 2, "keys")
        return bounds_must_score(queries, keys, scores["max_logit"], 2, top_n)

    queries, keys = planted_keys()
    assert must_score(keys, top_n=1).tolist() == [1.0, 1.0]  # loose bounds: all 4
    # Blocks of identical keys: the bound is the best key, and only the best block reaches it.
    tight = torch.cat([torch.full((2, 2), float(j)) for j in range(5)])[None].expand(2, -1, -1).contiguous()
    assert must_score(tight, top_n=1).tolist() == [0.25, 0.25]
    assert must_score(tight, top_n=4) is None  # 4 candidates: nothing to prune
