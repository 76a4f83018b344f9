"""evaluation/selection.py: where a query ranks a target block by summary, best key and attention mass."""

import math
from pathlib import Path

import torch
from transformers import AutoTokenizer

from evaluation.selection import (block_scores, bounds_must_score, copy_targets, hnsw_key_scores, prefill,
                                  record_layers, target_ranks, teacher_forced, token_chances, value_position)
from model import MiniMindConfig, MiniMindForCausalLM
from model.ann_attention import logn_scale

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
                        ("特别魔法数字中，金色猎鹰是95512。曹操", 95512)]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        start = value_position(tokenizer, ids, value)
        assert tokenizer.decode(ids[start:]).strip().startswith(str(value))
        assert not tokenizer.decode(ids[:start]).strip().endswith(str(value)[0])
        assert value_position(tokenizer, ids, 1234567) is None


def test_copy_targets_point_each_answer_token_at_the_digit_it_copies():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    english = tokenizer(" 4821937.", add_special_tokens=False).input_ids  # ' 4', six digits, '.'
    assert copy_targets(tokenizer, english, [50]) == [(f"d{i + 1}", 50 + i) for i in range(7)] + [("end", 56)]
    spaced = [token for text in (" ", "4", "8", "2", ".") for token in tokenizer(text, add_special_tokens=False).input_ids]
    assert copy_targets(tokenizer, spaced, [50]) == [("lead", 50), ("d1", 50), ("d2", 51), ("d3", 52), ("end", 52)]
    chinese = tokenizer("95512。", add_special_tokens=False).input_ids
    assert copy_targets(tokenizer, chinese, [9]) == [(f"d{i + 1}", 9 + i) for i in range(5)] + [("end", 13)]
    for text in ("no number.", " 12 and 34."):
        try:
            copy_targets(tokenizer, tokenizer(text, add_special_tokens=False).input_ids, [0])
        except ValueError as error:
            assert "does not spell one number a digit per token" in str(error)
        else:
            raise AssertionError(f"{text!r} was accepted")


def test_copy_targets_of_a_list_label_each_number_by_its_place():
    """A multivalue answer: the k-th number's digits copy the k-th prompt number's; between two
    numbers the first token copies the earlier number's last digit, the rest the later one's first."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    english = tokenizer(" 123, 4567.", add_special_tokens=False).input_ids  # ' 1' 2 3, ',', ' 4' 5 6 7, '.'
    assert copy_targets(tokenizer, english, [10, 40]) == (
        [("d1", 10), ("d2", 11), ("d3", 12), ("end", 12)]
        + [(f"n2.d{i + 1}", 40 + i) for i in range(4)] + [("n2.end", 43)])
    spaced = [token for text in (" ", "1", ",", " ", "4", "5", ".") for token in tokenizer(text, add_special_tokens=False).input_ids]
    assert copy_targets(tokenizer, spaced, [10, 40]) == [
        ("lead", 10), ("d1", 10), ("end", 10), ("n2.lead", 40), ("n2.d1", 40), ("n2.d2", 41), ("n2.end", 41)]
    chinese = tokenizer("12、345、67。", add_special_tokens=False).input_ids
    assert [label for label, _ in copy_targets(tokenizer, chinese, [5, 9, 30])] == [
        "d1", "d2", "end", "n2.d1", "n2.d2", "n2.d3", "n2.end", "n3.d1", "n3.d2", "n3.end"]
    assert copy_targets(tokenizer, chinese, [5, 9, 30])[3:7] == [("n2.d1", 9), ("n2.d2", 10), ("n2.d3", 11), ("n2.end", 11)]
    try:
        copy_targets(tokenizer, chinese, [5, 9])
    except ValueError as error:
        assert "does not spell 2 numbers a digit per token" in str(error)
    else:
        raise AssertionError("three numbers were taken for two")


def test_teacher_forced_probabilities_equal_decoding_token_by_token():
    """The answer's probabilities from a chunked prefill and one teacher-forced call equal those of a
    whole prefill and feeding the answer one token at a time (float64 weights; the probabilities
    come back as float32), with blocks retrieved along the way."""
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=256, max_position_embeddings=256, attn_impl="ann", ann_window=8, ann_block_size=4,
                            ann_top_n=2, ann_block_summary="keys")
    model = MiniMindForCausalLM(config).double().eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(std=0.3)
    # No token twice: capped keys are stored unrotated, so a repeated token's blocks would tie in layer 0.
    tokens = torch.randperm(256)[:76].tolist()
    prompt, answer = tokens[:70], tokens[70:]
    probabilities, best = token_chances(teacher_forced(model, prompt, answer, chunk=32), answer)
    cache = model.new_cache()
    with torch.inference_mode():
        logits = [model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]]
        logits += [model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1] for token in answer[:-1]]
    expected = torch.stack(logits).softmax(dim=-1)[torch.arange(6), torch.tensor(answer)]
    assert torch.allclose(probabilities.double(), expected, rtol=1e-6, atol=1e-9)
    assert best.tolist() == (torch.stack(logits).argmax(dim=-1) == torch.tensor(answer)).tolist()


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


def test_recorded_queries_are_those_the_layer_attends_with_log_n_scaling_included():
    """A layer with ann_logn_length records its queries scaled, as it attends and selects with them:
    the same weights without it record the same queries, unscaled."""
    def recorded(**overrides):
        torch.manual_seed(0)
        config = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                vocab_size=64, max_position_embeddings=256, attn_impl="ann", ann_window=8, ann_block_size=4,
                                ann_top_n=2, **overrides)
        model = MiniMindForCausalLM(config).eval()
        recorder = record_layers(model)[0]
        prefill(model, list(range(3, 43)), chunk=16)
        return recorder.recorded()[1]

    plain, scaled = recorded(), recorded(ann_logn_length=16)
    factor = logn_scale(torch.arange(40)[None], 16).float()[:, None, :, None]
    assert float(factor[0, 0, 15]) == 1.0 and float(factor[0, 0, 39]) > 1.3
    torch.testing.assert_close(scaled, plain * factor, atol=1e-5, rtol=1e-5)
