"""pruned_select (model/pruned_selection.py) selects what exact_select selects, scoring fewer blocks."""

import pytest
import torch

from model.pruned_selection import SuperBlockBounds, pruned_select
from model.retrieval import PrunedRetriever, block_summaries, exact_select, selection_queries
from tests.test_ann_attention import ann_model  # window 16, blocks of 8, top 2, 4 query and 2 KV heads

TOLERANCE = 1e-5
BLOCK = 4
HEAD_DIM = 8


def make_inputs(num_blocks, kind, summary, kv_heads, batch, queries=24, seed=0):
    """Realistic selection inputs from keys and queries: group_queries (b, g, s, e), summaries
    (b, g, m, e), and limits (b, s) that differ per row (0 .. m, always reaching m somewhere)."""
    generator = torch.Generator().manual_seed(seed)
    heads = 2 * kv_heads
    keys = torch.randn(batch, kv_heads, num_blocks * BLOCK, HEAD_DIM, generator=generator)
    q = torch.randn(batch, heads, queries, HEAD_DIM, generator=generator)
    if kind == "repetitive":
        # One 3-block passage over and over: many equal summaries, so many tied scores.
        keys = keys[:, :, : 3 * BLOCK].repeat(1, 1, -(-num_blocks // 3), 1)[:, :, : num_blocks * BLOCK]
    elif kind == "topics":
        # Runs of 32 blocks on one of 8 topics; each query seeks one: bounds prune some, not all.
        topics = 4.0 * torch.randn(8, HEAD_DIM, generator=generator)
        run_topics = torch.randint(0, 8, (-(-num_blocks // 32),), generator=generator)
        keys = keys + topics[run_topics].repeat_interleave(32 * BLOCK, dim=0)[: num_blocks * BLOCK]
        q = q + topics[torch.randint(0, 8, (queries,), generator=generator)][:, None].transpose(0, 1)
    elif kind == "needle":
        direction = torch.randn(HEAD_DIM, generator=generator)
        direction = direction / direction.norm()
        needle = num_blocks // 2 * BLOCK
        keys[:, :, needle : needle + BLOCK] = 60.0 * direction
        q = q + 3.0 * direction
    summaries = block_summaries(keys, 0, num_blocks, BLOCK, summary)
    group_queries = selection_queries(q, kv_heads, summary)
    limits = torch.randint(0, num_blocks + 1, (batch, queries), generator=generator)
    limits[:, -1] = num_blocks
    limits[0, 0] = 0
    return group_queries, summaries, limits


def selected_scores(group_queries, summaries, ids, valid):
    """(b, g, s, n) scores of the selected blocks, ascending, -inf for invalid slots."""
    scores = group_queries @ summaries.transpose(-1, -2)
    return scores.gather(-1, ids).masked_fill(~valid, float("-inf")).sort(dim=-1).values


def assert_same_selection(group_queries, summaries, limits, top_n, found):
    expected = exact_select(group_queries, summaries, limits, top_n)
    ids, valid = found
    assert ids.shape == expected[0].shape and valid.shape == expected[1].shape
    assert torch.equal(valid.sum(-1), expected[1].sum(-1)), "a query got a different number of candidates"
    assert bool((ids >= 0).all() and (ids < summaries.shape[2]).all()), "an id outside the blocks"
    got = selected_scores(group_queries, summaries, ids, valid)
    want = selected_scores(group_queries, summaries, *expected)
    scale = want.nan_to_num(0, 0, 0).abs().amax().clamp(min=1)
    difference = (got - want).nan_to_num(0)  # -inf - -inf: both invalid
    assert float(difference.abs().max()) <= TOLERANCE * scale
    # Where no two candidate scores lie within the tolerance, the chosen blocks are the same ones.
    all_scores = (group_queries @ summaries.transpose(-1, -2)).sort(dim=-1).values
    for index in torch.nonzero(valid.any(-1)).tolist():
        b, g, s = index
        candidates = all_scores[b, g, s][-int(limits[b, s]) :]
        if candidates.numel() > 1 and float(candidates.diff().min()) <= TOLERANCE * scale:
            continue
        assert set(ids[b, g, s][valid[b, g, s]].tolist()) == set(expected[0][b, g, s][expected[1][b, g, s]].tolist())


LENGTHS = [pytest.param(1, id="1block"), pytest.param(37, id="37blocks_odd_tail"), pytest.param(301, id="301blocks")]
TOP_NS = [pytest.param(n, id=f"top{n}") for n in (1, 4, 16)]
KINDS = ["random", "repetitive", "topics", "needle"]
SUMMARIES = ["bounds", "mean"]
SHAPES = [pytest.param(1, 1, id="mha_b1"), pytest.param(2, 2, id="gqa2_b2")]


@pytest.mark.parametrize("summary", SUMMARIES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("top_n", TOP_NS)
@pytest.mark.parametrize("num_blocks", LENGTHS)
@pytest.mark.parametrize("kv_heads,batch", SHAPES)
def test_pruned_select_matches_exact_select(num_blocks, top_n, kind, summary, kv_heads, batch):
    group_queries, summaries, limits = make_inputs(num_blocks, kind, summary, kv_heads, batch)
    found = pruned_select(group_queries, summaries, limits, top_n, group_sizes=(4, 3), query_group=8, min_blocks=0)
    assert_same_selection(group_queries, summaries, limits, top_n, found)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("summary", SUMMARIES)
def test_pruned_select_matches_exact_select_over_ten_thousand_blocks(kind, summary):
    group_queries, summaries, limits = make_inputs(10_007, kind, summary, kv_heads=2, batch=1, queries=16)
    found = pruned_select(group_queries, summaries, limits, 4)
    assert_same_selection(group_queries, summaries, limits, 4, found)


@pytest.mark.parametrize("top_n", [pytest.param(1, id="top1"), pytest.param(50, id="top_more_than_candidates")])
@pytest.mark.parametrize("min_blocks", [pytest.param(0, id="pruned"), pytest.param(10**9, id="every_candidate")])
def test_pruned_select_edge_limits(top_n, min_blocks):
    group_queries, summaries, _ = make_inputs(20, "random", "bounds", kv_heads=2, batch=2, queries=5)
    limits = torch.tensor([[0, 0, 0, 0, 0], [0, 1, 2, 19, 20]])
    found = pruned_select(group_queries, summaries, limits, top_n, group_sizes=(2, 2), min_blocks=min_blocks)
    assert_same_selection(group_queries, summaries, limits, top_n, found)
    assert not found[1][0].any(), "a row with no candidates selected something"
    no_candidates = pruned_select(group_queries, summaries, torch.zeros_like(limits), top_n, min_blocks=min_blocks)
    assert no_candidates[0].shape == (2, 2, 5, top_n) and not no_candidates[1].any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_pruned_select_scores_in_the_queries_dtype(dtype):
    group_queries, summaries, limits = make_inputs(200, "needle", "bounds", kv_heads=1, batch=1)
    group_queries = group_queries.to(dtype)
    ids, valid = pruned_select(group_queries, summaries, limits, 1, group_sizes=(4, 4), min_blocks=0)
    expected_ids, expected_valid = exact_select(group_queries, summaries, limits, 1)
    assert torch.equal(valid, expected_valid)
    # The needle wins every query that has it as a candidate, far beyond any rounding.
    has_needle = limits[0] > 100
    assert bool((ids[0, 0, has_needle, 0] == 100).all() and (expected_ids[0, 0, has_needle, 0] == 100).all())


@pytest.mark.parametrize("group_sizes", [pytest.param((4,), id="one_level"), pytest.param((3, 2, 5), id="three_levels")])
@pytest.mark.parametrize("growth", [pytest.param([1, 2, 3, 50, 51, 97], id="uneven"), pytest.param([64, 128], id="whole")])
def test_incremental_bounds_equal_recomputed_bounds(group_sizes, growth):
    _, summaries, _ = make_inputs(97, "random", "bounds", kv_heads=2, batch=2)
    bounds = SuperBlockBounds(group_sizes)
    for count in growth:
        bounds.extend(summaries[:, :, :count])
        fresh = SuperBlockBounds.of(summaries[:, :, :count], group_sizes)
        for (rows, span), (fresh_rows, fresh_span) in zip(bounds.levels(), fresh.levels()):
            assert span == fresh_span and torch.equal(rows, fresh_rows)  # max/min of the same values


def test_extend_recomputes_changed_blocks():
    _, summaries, _ = make_inputs(40, "random", "mean", kv_heads=1, batch=1)
    bounds = SuperBlockBounds((4, 4)).extend(summaries[:, :, :30])
    changed = summaries.clone()
    changed[:, :, 9] += 5.0
    bounds.extend(changed, first_changed=9)
    for (rows, _), (fresh_rows, _) in zip(bounds.levels(), SuperBlockBounds.of(changed, (4, 4)).levels()):
        assert torch.equal(rows, fresh_rows)


def test_precomputed_bounds_are_used_and_checked():
    group_queries, summaries, limits = make_inputs(300, "needle", "bounds", kv_heads=2, batch=2)
    bounds = SuperBlockBounds.of(summaries, (4, 4))
    found = pruned_select(group_queries, summaries, limits, 4, bounds=bounds, min_blocks=0)
    assert_same_selection(group_queries, summaries, limits, 4, found)
    with pytest.raises(ValueError, match="bounds cover 300 blocks, summaries have 299"):
        pruned_select(group_queries, summaries[:, :, :299], limits.clamp(max=299), 4, bounds=bounds, min_blocks=0)
    with pytest.raises(ValueError, match="group sizes must be integers >= 2"):
        SuperBlockBounds((4, 1))


@pytest.mark.parametrize("summary", SUMMARIES)
@pytest.mark.parametrize("top_n", [pytest.param(1, id="top1"), pytest.param(4, id="top4")])
def test_pruned_select_matches_exact_select_where_pruning_is_partial(summary, top_n):
    group_queries, summaries, limits = make_inputs(2000, "topics", summary, kv_heads=2, batch=2, queries=40)
    stats = {}
    found = pruned_select(group_queries, summaries, limits, top_n, stats=stats, group_sizes=(2, 2, 2, 2), query_group=1, min_blocks=0)
    assert_same_selection(group_queries, summaries, limits, top_n, found)
    assert stats["exact_scores"] < 0.5 * stats["dense_scores"], stats  # the descent ran and pruned


@pytest.mark.parametrize("summary", SUMMARIES)
def test_needle_prunes_most_blocks(summary):
    """One block far above the rest: with top_n 1 almost nothing else needs an exact score."""
    group_queries, summaries, _ = make_inputs(4096, "needle", summary, kv_heads=2, batch=1, queries=32)
    limits = torch.full((1, 32), 4096)
    stats = {}
    found = pruned_select(group_queries, summaries, limits, 1, stats=stats)
    assert_same_selection(group_queries, summaries, limits, 1, found)
    assert stats["exact_scores"] + stats["bound_scores"] < 0.1 * stats["dense_scores"], stats


@pytest.mark.parametrize("length", [300, 1500], ids=["masked", "tiled"])
@pytest.mark.parametrize("block_position", ["capped", "true"])
def test_pruned_retrieval_gives_exact_outputs_and_gradients(length, block_position):
    """The whole model trained one step's worth with retrieval "pruned" (branch and bound at every
    size, tests/conftest.py) against "exact": the same logits and gradients."""
    tokens = torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(length))
    results = []
    for retrieval in ("exact", "pruned"):
        model = ann_model(retrieval, ann_block_position=block_position).train()
        output = model(tokens, labels=tokens)
        output.loss.backward()
        results.append((output.logits.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (exact_logits, exact_grads), (pruned_logits, pruned_grads) = results
    torch.testing.assert_close(pruned_logits, exact_logits, atol=1e-5, rtol=1e-5)
    for name, grad in exact_grads.items():
        torch.testing.assert_close(pruned_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("chunk", [64, 333])
def test_pruned_retrieval_in_the_cache_equals_exact(chunk):
    """Chunked prefill then decoding steps: the cache's super-block bounds grow with its blocks and
    select what exact scoring selects (the same logits and greedy tokens)."""
    prompt = torch.randint(3, 300, (1, 700), generator=torch.Generator().manual_seed(chunk))
    runs = []
    for retrieval in ("exact", "pruned"):
        model = ann_model(retrieval)
        cache = model.new_cache(reserve=760)
        with torch.no_grad():
            logits = [model(part, cache=cache, use_cache=True).logits for part in prompt.split(chunk, dim=1)]
            tokens = [logits[-1][:, -1].argmax(-1)]
            for _ in range(40):
                step = model(tokens[-1][:, None], cache=cache, use_cache=True).logits
                logits.append(step)
                tokens.append(step[:, -1].argmax(-1))
        runs.append((torch.cat(logits, dim=1), torch.stack(tokens)))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(runs[1][1], runs[0][1])


@pytest.mark.parametrize("summary", SUMMARIES)
def test_pruned_retriever_rebuilds_the_bounds_of_changed_blocks(summary):
    """A cache that rewrites a block reports it (summaries_changed); the retriever's kept bounds then
    cover the new summary. A stronger needle written into an early block must be found there (top 1:
    with a stale bound its super-block would be pruned once the old needle sets the threshold)."""
    group_queries, summaries, limits = make_inputs(3000, "needle", summary, 1, 1)
    limits = torch.full_like(limits, summaries.shape[2])  # every query sees the needle: most nodes pruned
    retriever = PrunedRetriever()
    assert_same_selection(group_queries, summaries, limits, 1, retriever.select(group_queries, summaries, limits, 1))
    moved = summaries.clone()
    needle = summaries.shape[2] // 2
    moved[:, :, 5] = 2 * summaries[:, :, needle]
    retriever.summaries_changed(5)
    assert_same_selection(group_queries, moved, limits, 1, retriever.select(group_queries, moved, limits, 1))
