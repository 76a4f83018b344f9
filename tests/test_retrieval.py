"""Retrievers: exact top-n by inner product, auto choosing between exact and HNSW per query, settings."""

import pytest
import torch

from model import MiniMindConfig
from model.hnsw import HnswRetriever
from model import retrieval
from model.retrieval import AutoRetriever, build_retriever, candidate_count, exact_select
from tests.summaries import selected_sets, structured_summaries


def test_candidate_count_follows_the_definition():
    positions = torch.arange(100)[None]
    counts = candidate_count(positions, window=32, block_size=8)
    expected = [sum(1 for j in range(20) if j * 8 <= t - 32) for t in range(100)]
    assert counts[0].tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bounds_score_is_the_sum_over_heads_of_each_heads_bound(dtype):
    """[sum of max(q, 0), sum of min(q, 0)] . [max key, min key] = sum over the group's heads and
    channels of max(q_c * max_c, q_c * min_c): at least each head's best q . k in the block."""
    torch.manual_seed(0)
    b, g, r, s, d, block = 2, 2, 3, 5, 8, 4
    q = torch.randn(b, g * r, s, d, dtype=torch.float64)
    keys = torch.randn(b, g, 3 * block, d, dtype=torch.float64)
    summaries = retrieval.block_summaries(keys, 0, 3, block, "bounds")
    grouped = q.view(b, g, r, s, d)
    expected = torch.cat([grouped.clamp(min=0).sum(dim=2), grouped.clamp(max=0).sum(dim=2)], dim=-1)
    selecting = retrieval.selection_queries(q.to(dtype), g, "bounds")
    assert selecting.dtype == dtype and selecting.shape == (b, g, s, 2 * d)
    torch.testing.assert_close(selecting.double(), expected.to(dtype).double(), rtol=1e-2, atol=1e-2)
    scores = retrieval.selection_queries(q, g, "bounds") @ summaries.transpose(-1, -2)  # (b, g, s, m)
    per_key = torch.einsum("bgrsd,bgtd->bgrst", grouped, keys).view(b, g, r, s, 3, block)
    assert (scores >= per_key.amax(dim=-1).sum(dim=2) - 1e-9).all()


def test_exact_select_uses_only_real_candidates():
    queries, summaries = structured_summaries(10)
    limits = torch.tensor([[0, 1, 2, 10] * 16])
    block_ids, valid = exact_select(queries, summaries, limits, top_n=3)
    assert valid[0, 0, 0].sum() == 0 and valid[0, 0, 1].sum() == 1 and valid[0, 0, 2].sum() == 2
    scores = (queries @ summaries.transpose(-1, -2))[0, 0, 3]
    assert set(block_ids[0, 0, 3].tolist()) == set(scores.topk(3).indices.tolist())
    assert len(set(block_ids[0, 0, 3].tolist())) == 3


def test_auto_switches_at_the_threshold():
    queries, summaries = structured_summaries(64)
    retriever = AutoRetriever(32, HnswRetriever(32, 80, 64))
    retriever.select(queries, summaries, torch.full((1, 64), 31), 4)
    assert retriever.hnsw.graphs is None
    retriever.select(queries, summaries, torch.full((1, 64), 40), 4)
    assert retriever.hnsw.stored_blocks(0) == 40


def test_auto_chooses_per_query_not_per_call():
    """Queries below the threshold get exact's answer, the others HNSW's, in one call."""
    queries, summaries = structured_summaries(200, seed=3)
    limits = torch.arange(64)[None] * 3  # 0 .. 189 candidates
    far = (limits[0] >= 100).tolist()
    found = selected_sets(*AutoRetriever(100, HnswRetriever(4, 16, 8)).select(queries, summaries, limits, 4))
    exact = selected_sets(*exact_select(queries, summaries, limits, 4))
    hnsw = selected_sets(*HnswRetriever(4, 16, 8).select(queries, summaries, limits, 4))
    assert any(h != e for h, e, is_far in zip(hnsw, exact, far) if not is_far)  # the choice shows
    assert found == [h if is_far else e for h, e, is_far in zip(hnsw, exact, far)]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(ann_window=40, ann_block_size=16), "must be a multiple of ann_block_size"),
        (dict(ann_retrieval="faiss"), "ann_retrieval must be one of"),
        (dict(attn_impl="sparse"), "attn_impl must be one of"),
        (dict(ann_block_summary="median"), "ann_block_summary must be one of"),
        (dict(ann_top_n=-1), "ann_top_n must be a non-negative integer"),
        (dict(hidden_size=100, num_attention_heads=3), "must divide hidden_size"),
        (dict(num_attention_heads=8, num_key_value_heads=3), "must divide num_attention_heads"),
        (dict(hnsw_m=0), "hnsw_m must be a positive integer"),
        (dict(ann_block_summary="keys", ann_retrieval="pruned"), "set ann_retrieval to 'exact', 'hnsw' or 'auto'"),
        (dict(hnsw_keys_per_head=0), "hnsw_keys_per_head must be a positive integer"),
        (dict(num_hidden_layers=4, ann_retrieval_layers=[4]), r"distinct layer indices in 0..num_hidden_layers-1 \(4 layers\)"),
        (dict(ann_retrieval_layers=[1, 1]), "distinct layer indices"),
        (dict(ann_retrieval_layers=["1"]), "distinct layer indices"),
        (dict(ann_retrieval_layers=2), "must be None or distinct layer indices"),
        (dict(ann_logn_length=1), "ann_logn_length must be None or an integer >= 2"),
        (dict(ann_logn_length=True), "ann_logn_length must be None or an integer >= 2"),
        (dict(ann_logn_length=512.0), "ann_logn_length must be None or an integer >= 2"),
        (dict(ann_batch_distractors=1), "ann_batch_distractors must be true or false"),
        (dict(ann_batch_distractors=True, ann_block_position="true"), "ann_batch_distractors needs ann_block_position 'capped'"),
        (dict(ann_distractor_memory=-1), r"ann_distractor_memory must be an integer >= 0"),
        (dict(ann_distractor_memory=2.0, ann_batch_distractors=True), r"ann_distractor_memory must be an integer >= 0"),
        (dict(ann_distractor_memory=2), "ann_distractor_memory needs ann_batch_distractors"),
        (dict(ann_distractor_blocks=-1), r"ann_distractor_blocks must be an integer >= 0"),
        (dict(ann_distractor_blocks=True, ann_batch_distractors=True), r"ann_distractor_blocks must be an integer >= 0"),
        (dict(ann_distractor_blocks=2), "ann_distractor_blocks needs ann_batch_distractors"),
    ],
)
def test_invalid_settings_fail_with_a_clear_message(settings, message):
    with pytest.raises(ValueError, match=message):
        MiniMindConfig(**settings)


def test_build_retriever_names():
    config = MiniMindConfig()
    assert type(build_retriever(config, "hnsw")).__name__ == "HnswRetriever"
    keys_config = MiniMindConfig(ann_block_summary="keys", ann_retrieval="hnsw")
    assert type(build_retriever(keys_config)).__name__ == "KeyHnswRetriever"
    assert type(build_retriever(keys_config, "auto").hnsw).__name__ == "KeyHnswRetriever"
    with pytest.raises(ValueError, match="unknown retrieval"):
        build_retriever(config, "nearest")


@pytest.mark.parametrize("step", [4, 16, 1 << 13], ids=["1-block-steps", "4-block-steps", "one-step"])
def test_keys_scores_are_each_heads_best_key_summed_over_the_group(monkeypatch, step):
    """"keys" scores a block by the sum over the group's heads of each head's largest q . k, in
    steps of KEYS_PER_SCORING_STEP keys; every step size gives the spelled-out scores, and exact
    selection takes the top of them."""
    monkeypatch.setattr(retrieval, "KEYS_PER_SCORING_STEP", step)
    generator = torch.Generator().manual_seed(5)
    b, h, g, s, d, block_size, m = 2, 4, 2, 6, 8, 4, 9
    q = torch.randn(b, h, s, d, generator=generator, dtype=torch.float64)
    keys = torch.randn(b, g, m * block_size, d, generator=generator, dtype=torch.float64)
    group_queries = retrieval.selection_queries(q, g, "keys")
    summaries = retrieval.block_summaries(keys, 0, m, block_size, "keys")
    scores = retrieval.summary_scores(group_queries, summaries)
    for row, head, query, block in [(0, 0, 0, 0), (1, 1, 5, 8), (0, 1, 3, 4)]:
        heads = range(head * (h // g), (head + 1) * (h // g))
        block_keys = keys[row, head, block * block_size : (block + 1) * block_size]
        expected = sum(max(float(q[row, r, query] @ key) for key in block_keys) for r in heads)
        assert abs(float(scores[row, head, query, block]) - expected) < 1e-10
    ids, valid = exact_select(group_queries, summaries, torch.full((b, s), m), top_n=3)
    assert valid.all() and torch.equal(ids.sort(dim=-1).values, scores.topk(3, dim=-1).indices.sort(dim=-1).values)


def test_keys_summaries_are_the_stored_keys_not_a_copy():
    keys = torch.randn(1, 2, 40, 8)
    summaries = retrieval.block_summaries(keys, 0, 5, 8, "keys")
    assert summaries.shape == (1, 2, 5, 8, 8) and summaries.data_ptr() == keys.data_ptr()
