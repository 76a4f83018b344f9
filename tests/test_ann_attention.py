"""ANN attention against a naive reference built from the definition (model/ann_attention.py)."""

import itertools

import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM
from model import ann_attention, retrieval
from model.ann_attention import AnnAttention
from model.attention import previous_inputs
from model.kv_cache import KVBuffer
from model.rope import Rope
from model.retrieval import exact_select


THETA = 100.0  # a small RoPE base, so that rotations matter at the tests' short lengths


def rope_for(batch, length, head_dim, first=0, dtype=torch.float64):
    positions = (torch.as_tensor(first).view(-1, 1) + torch.arange(length)).expand(batch, length)
    return Rope(positions, head_dim, THETA, dtype)


def run(core, q, k, v, starts=None, ends=None, cache=None):
    """Call an attention core with the Rope of the new tokens' positions."""
    rope = rope_for(q.shape[0], q.shape[2], q.shape[3], 0 if starts is None else starts, q.dtype)
    return core(q, k, v, starts, ends, cache, rope)


def reference_block_scores(block_q, block_k, block_size, summary):
    """(b, g, t_query, m) scores of every complete block: the group's summed queries . mean key; the
    sum over the group's heads of max over the block's keys of q . k ("keys"); or of the
    channel-wise products' upper bound, sum_c max(q_c * k_c) for k in the block, spelled out
    channel by channel ("bounds")."""
    b, h, length, d = block_q.shape
    g = block_k.shape[1]
    num_blocks = length // block_size
    blocks = block_k[:, :, : num_blocks * block_size].reshape(b, g, num_blocks, block_size, d)
    grouped_q = block_q.reshape(b, g, h // g, length, d)
    if summary == "mean":
        return grouped_q.sum(2) @ blocks.mean(3).transpose(-1, -2)
    if summary == "keys":  # each head's largest q . k in the block, summed over the group's heads
        return (grouped_q[:, :, :, :, None, None, :] * blocks[:, :, None, None]).sum(-1).amax(dim=5).sum(dim=2)
    # products (b, g, r, t_query, m, B, d): each channel's largest product over the block's keys
    products = grouped_q[:, :, :, :, None, None, :] * blocks[:, :, None, None]
    return products.amax(dim=5).sum(dim=-1).sum(dim=2)


def reference_masks(block_q, block_k, window, block_size, top_n, summary, foreign=(0, 0)):
    """The definition, spelled out: (b, g, t_query, t_key) boolean masks of the window keys and of
    the retrieved keys each query sees, from queries and keys in the blocks' frame. foreign
    (blocks F, extra N), N > 0: the top_n come from blocks F on and the N best of blocks 0 .. F-1
    are added (ann_distractor_blocks)."""
    b, h, length, d = block_q.shape
    g = block_k.shape[1]
    positions = torch.arange(length)
    query_pos, key_pos = positions[:, None], positions[None, :]
    window_mask = ((key_pos <= query_pos) & (key_pos > query_pos - window)).expand(b, g, length, length)
    far_mask = torch.zeros(b, g, length, length, dtype=torch.bool)
    num_blocks = length // block_size
    if num_blocks == 0 or top_n == 0:
        return window_mask, far_mask
    scores = reference_block_scores(block_q, block_k, block_size, summary)
    block_starts = torch.arange(num_blocks) * block_size
    is_candidate = block_starts[None, :] <= query_pos - window  # (t_query, m)
    scores = scores.masked_fill(~is_candidate, float("-inf"))

    def best(allowed, n):
        # The top min(n, m) of the allowed blocks, keeping only those (the others score -inf, so
        # they are picked only when fewer than n are allowed).
        top = scores.masked_fill(~allowed, float("-inf")).topk(min(n, num_blocks), dim=-1).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & allowed

    foreign_blocks, extra = foreign
    if extra:
        is_foreign = torch.arange(num_blocks) < foreign_blocks
        chosen = best(is_candidate & ~is_foreign, top_n) | best(is_candidate & is_foreign, extra)
    else:
        chosen = best(is_candidate, top_n)
    chosen_keys = chosen.repeat_interleave(block_size, dim=-1)  # (b, g, t_query, m * B)
    far_mask[..., : num_blocks * block_size] = chosen_keys
    far_mask &= key_pos <= query_pos - window
    return window_mask, far_mask


def reference_frames(q, k, window, block_position):
    """Unrotated q (b, h, t, d), k (b, g, t, d) -> (window_q, window_k, block_q, block_k): rotated at
    their positions for the window; for the blocks, q at W + (t mod W) and k unrotated (capped), or
    the same as the window's (true)."""
    b, _, length, d = q.shape
    rope = rope_for(b, length, d, dtype=q.dtype)
    window_q, window_k = rope(q), rope(k)
    if block_position == "capped":
        capped = (window + torch.arange(length) % window).expand(b, length)
        return window_q, window_k, rope.at(q, capped), k
    return window_q, window_k, window_q, window_k


def selection_margins(q, k, window, block_size, top_n, block_position, summary):
    """(b, g, t): per query and kv head, the reference's n-th best candidate score minus the best one
    it leaves out, relative to the larger of the two in size (inf where every candidate or none is
    selected).
    Arithmetic of lower precision may swap two blocks this close."""
    _, _, block_q, block_k = reference_frames(q, k, window, block_position)
    scores = reference_block_scores(block_q, block_k, block_size, summary)
    positions = torch.arange(q.shape[2])[:, None]
    candidates = torch.arange(scores.shape[-1])[None, :] * block_size <= positions - window
    scores = scores.masked_fill(~candidates, float("-inf"))
    margins = torch.full(scores.shape[:3], float("inf"), dtype=scores.dtype)
    if 0 < top_n < scores.shape[-1]:
        best = scores.topk(top_n + 1, dim=-1).values
        kept, left = best[..., top_n - 1], best[..., top_n]
        finite = torch.isfinite(left)
        gap = (kept - left) / torch.maximum(kept.abs(), left.abs()).clamp(min=1e-12)
        margins = torch.where(finite, gap, margins)
    return margins


def reference_attention(q, k, v, window, block_size, top_n, block_position="capped", summary="bounds", foreign=(0, 0)):
    """Unrotated q (b, h, t, d), k/v (b, g, t, d) -> out: window keys at their true distance, retrieved
    keys at W + (t mod W) (capped) or at their true distance; foreign: see reference_masks."""
    b, h, length, d = q.shape
    groups = h // k.shape[1]
    window_q, window_k, block_q, block_k = reference_frames(q, k, window, block_position)
    window_mask, far_mask = reference_masks(
        block_q.detach(), block_k.detach(), window, block_size, top_n, summary, foreign
    )

    def logits(queries, keys):
        return queries @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2) / d**0.5

    window_mask, far_mask = window_mask.repeat_interleave(groups, 1), far_mask.repeat_interleave(groups, 1)
    scores = torch.where(window_mask, logits(window_q, window_k), logits(block_q, block_k))
    scores = scores.masked_fill(~(window_mask | far_mask), float("-inf"))
    return scores.softmax(-1) @ v.repeat_interleave(groups, dim=1)


def make_core(
    heads, kv_heads, window, block_size, top_n, retrieval="exact", head_dim=8, block_position="capped", summary="bounds",
    **overrides,
):
    config = MiniMindConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        attn_impl="ann",
        ann_window=window,
        ann_block_size=block_size,
        ann_top_n=top_n,
        ann_retrieval=retrieval,
        ann_block_position=block_position,
        ann_block_summary=summary,
        **overrides,
    )
    return AnnAttention(config)


def random_qkv(batch, heads, kv_heads, length, head_dim=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, head_dim, generator=generator, dtype=dtype)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, head_dim, generator=generator, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def assert_same_outputs_and_gradients(out, expected, inputs):
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), inputs)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-10, rtol=1e-10)


BLOCK = 8
GRID = list(
    itertools.product(
        [1, BLOCK - 1, BLOCK, 3 * BLOCK + 5, 512],  # seq_len
        [(BLOCK, BLOCK), (4 * BLOCK, BLOCK), (8, 4)],  # (window, block size)
        [0, 1, 3, 10_000],  # top_n; 10_000 covers every candidate
        [(4, 4), (4, 2)],  # (heads, kv heads): MHA and GQA
        [2],  # batch (rows are independent; batch 1 is covered by the decoding and model tests)
        ["capped", "true"],  # ann_block_position
        ["bounds", "mean", "keys"],  # ann_block_summary
    )
)


@pytest.fixture(params=["masked_sdpa", "tiled"])
def path(request, monkeypatch):
    """Both implementations of the full-sequence pass: selection mask + SDPA, and gathered tiles."""
    if request.param == "tiled":
        monkeypatch.setattr(ann_attention, "MASKED_SDPA_MAX_LEN", 0)
        monkeypatch.setattr(ann_attention, "QUERY_TILE", 64)
    return request.param


@pytest.mark.parametrize("length,window_block,top_n,heads,batch,block_position,summary", GRID)
def test_matches_reference_outputs_and_gradients(path, length, window_block, top_n, heads, batch, block_position, summary):
    window, block_size = window_block
    num_heads, kv_heads = heads
    core = make_core(num_heads, kv_heads, window, block_size, top_n, block_position=block_position, summary=summary)
    q, k, v = random_qkv(batch, num_heads, kv_heads, length, seed=length + top_n)
    out = run(core, q, k, v)
    expected = reference_attention(q, k, v, window, block_size, top_n, block_position, summary)
    assert_same_outputs_and_gradients(out, expected, (q, k, v))


# (dtype, tolerance, selection margin) on CUDA against the float64 reference of the same (rounded)
# inputs: queries whose n-th and (n+1)-th candidate blocks score closer than the margin (relative)
# may select either in that precision, and are left out of the comparison.
CUDA_DTYPES = [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 5e-2, 5e-2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance,margin", CUDA_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("length,window_block,top_n,heads,batch,block_position,summary", GRID[::23])
def test_matches_reference_on_cuda(path, dtype, tolerance, margin, length, window_block, top_n, heads, batch, block_position,
                                   summary):
    window, block_size = window_block
    num_heads, kv_heads = heads
    core = make_core(num_heads, kv_heads, window, block_size, top_n, block_position=block_position, summary=summary)
    inputs = [x.detach().to(dtype) for x in random_qkv(batch, num_heads, kv_heads, length, seed=length + top_n)]
    positions = torch.arange(length, device="cuda").expand(batch, length)
    out = core(*(x.cuda() for x in inputs), None, None, None, Rope(positions, inputs[0].shape[-1], THETA, dtype))
    exact = [x.double() for x in inputs]
    expected = reference_attention(*exact, window, block_size, top_n, block_position, summary)
    clear = selection_margins(exact[0], exact[1], window, block_size, top_n, block_position, summary) >= margin
    clear = clear.repeat_interleave(num_heads // kv_heads, dim=1)  # (b, h, t)
    assert clear.double().mean() >= 0.4  # most queries are compared (bf16 sets aside up to half of mean's)
    torch.testing.assert_close(out.double().cpu()[clear], expected[clear], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("top_n", [0, 1, 3])
def test_selection_margins_are_the_gap_between_the_last_kept_and_first_left_block(top_n):
    """The margins the CUDA test leaves near-ties out by: inf where every candidate is kept, else the
    relative gap between the n-th and (n+1)-th best candidate, recomputed here from the scores."""
    q, k, _ = (x.detach() for x in random_qkv(1, 4, 2, 64, seed=top_n))
    margins = selection_margins(q, k, 8, 4, top_n, "capped", "bounds")
    _, _, block_q, block_k = reference_frames(q, k, 8, "capped")
    scores = reference_block_scores(block_q, block_k, 4, "bounds")
    for position in (8, 8 + 4 * top_n, 63):
        count = (position - 8) // 4 + 1
        row = scores[0, 1, position, :count].sort(descending=True).values
        if count <= top_n or top_n == 0:
            assert margins[0, 1, position] == float("inf")
        else:
            gap = (row[top_n - 1] - row[top_n]) / max(abs(row[top_n - 1]), abs(row[top_n]))
            assert margins[0, 1, position].item() == pytest.approx(gap.item(), rel=1e-12)


@pytest.mark.parametrize("window,length", [(24, 200), (24, 72), (96, 300), (96, 50)])
@pytest.mark.parametrize("block_position", ["capped", "true"])
def test_tiles_when_the_window_does_not_divide_the_tile(monkeypatch, window, length, block_position):
    """Tiles round up to whole windows (24 -> tiles of 72 for QUERY_TILE 64) or, with a window
    longer than a tile (96), hold one chunk; outputs and gradients still follow the definition."""
    monkeypatch.setattr(ann_attention, "MASKED_SDPA_MAX_LEN", 0)
    monkeypatch.setattr(ann_attention, "QUERY_TILE", 64)
    core = make_core(4, 2, window, 8, 3, block_position=block_position)
    q, k, v = random_qkv(2, 4, 2, length, seed=window + length)
    out = run(core, q, k, v)
    expected = reference_attention(q, k, v, window, 8, 3, block_position)
    assert_same_outputs_and_gradients(out, expected, (q, k, v))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_true_positions_with_top_n_covering_every_candidate_is_dense_attention(heads):
    num_heads, kv_heads = heads
    q, k, v = random_qkv(2, num_heads, kv_heads, 300, dtype=torch.float32)
    out = run(make_core(num_heads, kv_heads, 16, 8, 10_000, block_position="true"), q, k, v)
    groups = num_heads // kv_heads
    rope = rope_for(2, 300, 8, dtype=torch.float32)
    dense = torch.nn.functional.scaled_dot_product_attention(
        rope(q), rope(k).repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )
    assert (out - dense).abs().max().item() <= 1e-5


def test_tiled_path_equals_dense_when_blocks_cover_all(path):
    """The tiled path itself (not the dense shortcut): force it with top_n just below coverage."""
    q, k, v = random_qkv(1, 4, 2, 600)
    core = make_core(4, 2, 16, 8, 72, block_position="true")
    assert not core.is_dense(599)
    out = run(core, q, k, v)
    dense = reference_attention(q, k, v, 10**9, 8, 0)
    # Only the last queries miss blocks; everything earlier is exactly dense.
    last_full = 16 + 72 * 8
    torch.testing.assert_close(out[:, :, :last_full], dense[:, :, :last_full], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("block_position", ["capped", "true"])
def test_capped_blocks_do_not_depend_on_their_distance(path, block_position):
    """One distinctive block among identical filler keys: with capped positions, the last query's
    output is the same whether the block lies 64 or 4000 positions back; true positions are not."""
    window, block_size, heads, d = 16, 8, 4, 8
    generator = torch.Generator().manual_seed(0)
    filler_k, filler_v, query = (torch.randn(d, generator=generator, dtype=torch.float64) for _ in range(3))
    block_k = torch.randn(8, d, generator=generator, dtype=torch.float64) + 3 * query
    block_v = torch.randn(8, d, generator=generator, dtype=torch.float64)
    outputs = []
    for length in (64 + 16 * 10, 4000 + 16 * 10):
        k = filler_k.expand(1, 2, length, d).clone()
        v = filler_v.expand(1, 2, length, d).clone()
        k[:, :, 8:16] = block_k
        v[:, :, 8:16] = block_v
        q = query.expand(1, heads, length, d).contiguous()
        core = make_core(heads, 2, window, block_size, 2, block_position=block_position)
        outputs.append(run(core, q, k, v)[:, :, -1])
    if block_position == "capped":
        torch.testing.assert_close(outputs[0], outputs[1], atol=1e-12, rtol=0)
    else:
        assert (outputs[0] - outputs[1]).abs().max() > 1e-3


def test_causality(path):
    core = make_core(4, 2, 16, 8, 2)
    q, k, v = random_qkv(2, 4, 2, 200)
    out = run(core, q, k, v)
    cut = 97
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, cut + 1 :] = torch.randn_like(x[:, :, cut + 1 :])
    out2 = run(core, q2, k2, v2)
    torch.testing.assert_close(out[:, :, : cut + 1], out2[:, :, : cut + 1], atol=0, rtol=0)


def test_heads_are_not_flattened_into_one_softmax():
    core = make_core(4, 2, 16, 8, 2)
    q, k, v = random_qkv(1, 4, 2, 120)
    out = run(core, q, k, v)
    assert not torch.allclose(out[:, 0], out[:, 1])
    assert not torch.allclose(out[:, 0], out[:, 2])


# Every retrieval over bounds, and the graphs over keys that "keys" selection searches
RETRIEVALS_AND_SUMMARIES = [(r, "bounds") for r in ("exact", "hnsw", "auto", "pruned")] + [("hnsw", "keys"), ("auto", "keys")]


@pytest.mark.parametrize("block_position", ["capped", "true"])
@pytest.mark.parametrize("retrieval,summary", RETRIEVALS_AND_SUMMARIES)
@pytest.mark.parametrize("chunks", [[1] * 90, [37, 1, 1, 20, 31], [90]])
def test_cached_prefill_and_decode_equal_full_pass(path, retrieval, summary, chunks, block_position):
    core = make_core(4, 2, 16, 8, 2, retrieval=retrieval, block_position=block_position, summary=summary)
    q, k, v = random_qkv(2, 4, 2, 90)
    full = run(core, q, k, v)
    cache = core.new_layer_cache()
    outputs, begin = [], 0
    for size in chunks:
        starts = torch.full((2,), begin)
        sl = slice(begin, begin + size)
        outputs.append(run(core, q[:, :, sl], k[:, :, sl], v[:, :, sl], starts, starts + size, cache))
        begin += size
    torch.testing.assert_close(torch.cat(outputs, dim=2), full, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("retrieval", ["exact", "pruned"])
@pytest.mark.parametrize("block_position", ["capped", "true"])
def test_decoding_after_rewriting_cached_keys_equals_a_full_pass(block_position, retrieval):
    """Decoding keeps its window keys from step to step (WindowRing): after the last ten cached
    positions are written again in one call, the next step, at the position the kept window
    ends, must read the new keys."""
    first, size = 40, 10
    core = make_core(4, 2, 16, 8, 2, retrieval=retrieval, block_position=block_position)
    old, new = random_qkv(1, 4, 2, 60, seed=1), random_qkv(1, 4, 2, 60, seed=2)
    rewritten = [torch.cat([a[:, :, :first], b[:, :, first:]], dim=2).detach() for a, b in zip(old, new)]
    cache = core.new_layer_cache()
    begin = torch.zeros(1, dtype=torch.long)
    run(core, *(x[:, :, :30].detach() for x in old), begin, begin + 30, cache)
    for position in range(30, first + size):
        starts = torch.full((1,), position)
        run(core, *(x[:, :, position : position + 1].detach() for x in old), starts, starts + 1, cache)
    starts = torch.full((1,), first)
    outputs = [run(core, *(x[:, :, first : first + size] for x in rewritten), starts, starts + size, cache)]
    for position in range(first + size, 60):
        starts = torch.full((1,), position)
        outputs.append(run(core, *(x[:, :, position : position + 1] for x in rewritten), starts, starts + 1, cache))
    expected = run(core, *rewritten)[:, :, first:]
    torch.testing.assert_close(torch.cat(outputs, dim=2), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("top_n", [3, 10_000])
@pytest.mark.parametrize("retrieval", ["exact", "hnsw"])
def test_rows_at_different_positions_equal_their_own_full_pass(monkeypatch, retrieval, top_n):
    """One cached call whose rows start and end at different positions (row 1 was shorter, its
    padding is overwritten) gives each row what a pass over that row alone gives. With top_n
    covering every candidate, a bound on top_n taken from the wrong row would drop blocks."""
    monkeypatch.setattr(ann_attention, "QUERY_TILE", 64)  # several tiles, the last one padded
    core = make_core(4, 2, 16, 8, top_n, retrieval=retrieval)
    lengths, first_call = (210, 185), 60
    rows = [random_qkv(1, 4, 2, length, seed=length) for length in lengths]
    cache = core.new_layer_cache()
    starts, ends = torch.zeros(2, dtype=torch.long), torch.tensor([first_call, 35])
    first_inputs = [
        torch.cat([row0[:, :, :first_call], torch.cat([row1[:, :, :35], torch.randn_like(row1[:, :, 35:first_call])], 2)])
        for row0, row1 in zip(*rows)
    ]
    first_out = run(core, *first_inputs, starts, ends, cache)
    starts, ends = ends, torch.tensor(lengths)
    second_inputs = [torch.cat([row0[:, :, first_call:], row1[:, :, 35:]]) for row0, row1 in zip(*rows)]
    second_out = run(core, *second_inputs, starts, ends, cache)
    for row, (begin, end) in enumerate(zip(starts.tolist(), lengths)):
        alone = run(core, *rows[row])[0]
        torch.testing.assert_close(first_out[row, :, :begin], alone[:, :begin], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(second_out[row, :, : end - begin], alone[:, begin:end], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("offset", [0, 20, 63, 200])
@pytest.mark.parametrize("first,ends", [((0, 0), (64, 64)), ((40, 3), (90, 100)), ((70, 10), (75, 200)), ((5, 5), (5, 30))])
def test_host_bound_on_candidates_equals_the_device_maximum(first, ends, offset):
    """Tiles take top_n bounds from host ints, not from the limits tensor: they must agree,
    including queries past a row's end (counted at its last real token)."""
    spans = ann_attention.query_spans(torch.tensor(first), torch.tensor(ends), 2, offset + 1, "cpu")
    limits = ann_attention.candidate_limits(spans.positions(0, offset + 1), spans.ends, 16, 8)
    assert ann_attention.most_candidates(spans, offset, 16, 8) == int(limits.max())
    assert ann_attention.candidate_bounds(spans, 0, offset, 16, 8) == (int(limits.min()), int(limits.max()))


def general_path_only(monkeypatch):
    monkeypatch.setattr(ann_attention, "decodes_one_position", lambda spans, length: False)


@pytest.mark.parametrize("window,block_size,top_n", [(16, 8, 1), (16, 8, 3), (8, 4, 10_000), (12, 4, 2)])
@pytest.mark.parametrize("heads,batch", [((4, 4), 1), ((4, 2), 2)], ids=["mha-b1", "gqa-b2"])
@pytest.mark.parametrize("block_position", ["capped", "true"])
@pytest.mark.parametrize("summary", ["bounds", "mean", "keys"])
def test_decode_step_equals_the_tiled_path(monkeypatch, window, block_size, top_n, heads, batch, block_position, summary):
    """The one-token decode shortcut gives what the general tiled path gives, step by step from
    positions below the window (dense) through every phase of a block, with top_n below and
    above the number of candidates (where the shortcut skips selection)."""
    num_heads, kv_heads = heads
    core = make_core(num_heads, kv_heads, window, block_size, top_n, block_position=block_position, summary=summary)
    q, k, v = (x.detach() for x in random_qkv(batch, num_heads, kv_heads, 60, seed=top_n + window))
    prefill = 5
    outputs, shortcut_steps = {}, []
    decode_step = core.decode_step
    monkeypatch.setattr(core, "decode_step", lambda *args: shortcut_steps.append(1) or decode_step(*args))
    for name in ("shortcut", "general"):
        if name == "general":
            # (true positions with top_n covering every candidate are dense attention throughout)
            assert shortcut_steps or core.is_dense(q.shape[2] - 1), "the shortcut was never taken"
            general_path_only(monkeypatch)
        cache = core.new_layer_cache()
        starts = torch.zeros(batch, dtype=torch.long)
        steps = [run(core, q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], starts, starts + prefill, cache)]
        for position in range(prefill, q.shape[2]):
            starts = torch.full((batch,), position)
            sl = slice(position, position + 1)
            steps.append(run(core, q[:, :, sl], k[:, :, sl], v[:, :, sl], starts, starts + 1, cache))
        outputs[name] = torch.cat(steps, dim=2)
    torch.testing.assert_close(outputs["shortcut"], outputs["general"], atol=1e-10, rtol=1e-10)


def ann_model(retrieval="exact", **overrides):
    torch.manual_seed(0)
    settings = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        attn_impl="ann",
        ann_window=16,
        ann_block_size=8,
        ann_top_n=2,
        ann_retrieval=retrieval,
        ann_auto_threshold=4,
    )
    settings.update(overrides)
    model = MiniMindForCausalLM(MiniMindConfig(**settings)).eval()
    for layer in model.model.layers:  # trained shifts are not zero; the test must see them act
        for weights in (layer.self_attn.k_shift, layer.self_attn.k_shift_wide, layer.self_attn.q_shift):
            if weights is not None:
                torch.nn.init.normal_(weights)
    return model


# (key_shift, query_shift): none, the one-token smeared key, two-token keys with one-token queries, three with two, four with three
TOKEN_SHIFTS = [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)]


@pytest.mark.parametrize("key_shift,query_shift", TOKEN_SHIFTS)
@pytest.mark.parametrize("block_position", ["capped", "true"])
@pytest.mark.parametrize("retrieval,summary", RETRIEVALS_AND_SUMMARIES)
def test_model_full_forward_equals_step_by_step_decoding(path, retrieval, summary, block_position, key_shift, query_shift):
    model = ann_model(
        retrieval, ann_block_position=block_position, ann_block_summary=summary, key_shift=key_shift, query_shift=query_shift
    )
    input_ids = torch.randint(3, 300, (2, 120))
    full = model(input_ids).logits
    cache = model.new_cache()
    steps = [model(input_ids[:, :40], cache=cache, use_cache=True).logits]
    for position in range(40, 120):
        steps.append(model(input_ids[:, position : position + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-4
    prompt = input_ids[:, :100]
    greedy = model.generate(prompt, max_new_tokens=40, eos_token_id=-1)
    # Greedy means: every generated token is the argmax of one full (causal) forward at its position.
    rechecked = model(greedy[:, :-1]).logits[:, 99:].argmax(-1)
    assert torch.equal(greedy[:, :100], prompt)
    assert torch.equal(greedy[:, 100:], rechecked)


@pytest.mark.parametrize("key_shift,query_shift", TOKEN_SHIFTS)
@pytest.mark.parametrize("retrieval", ["exact", "hnsw"])
def test_left_padded_batch_and_changing_batch_size(retrieval, key_shift, query_shift):
    model = ann_model(retrieval, key_shift=key_shift, query_shift=query_shift)
    long_row = torch.randint(3, 300, (1, 90))
    short_row = torch.randint(3, 300, (1, 61))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 29, dtype=torch.long), short_row], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :29] = 0
    padded = model.generate(batch, attention_mask=mask, max_new_tokens=30, eos_token_id=-1)
    alone_long = model.generate(long_row, max_new_tokens=30, eos_token_id=-1)
    alone_short = model.generate(short_row, max_new_tokens=30, eos_token_id=-1)
    assert torch.equal(padded[0, 90:], alone_long[0, 90:])
    assert torch.equal(padded[1, 90:], alone_short[0, 61:])
    triple = model.generate(torch.cat([long_row] * 3), max_new_tokens=5, eos_token_id=-1)
    assert torch.equal(triple[2], alone_long[0, :95])


def test_bf16_autocast_forward_backward_and_generation():
    model = ann_model("hnsw")
    input_ids = torch.randint(3, 300, (2, 100))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
        tokens = model.generate(input_ids[:, :80], max_new_tokens=8)
    assert torch.isfinite(out.loss)
    assert tokens.shape == (2, 88)
    model_bf16 = ann_model("hnsw").to(torch.bfloat16)
    assert torch.isfinite(model_bf16(input_ids).logits.float()).all()
    assert model_bf16.generate(input_ids[:, :80], max_new_tokens=8).shape == (2, 88)


def test_token_shift_is_the_plain_model_at_zero_and_its_weights_round_trip(tmp_path):
    plain = ann_model()
    shifted = MiniMindForCausalLM(MiniMindConfig(**{**plain.config.to_dict(), "key_shift": 2, "query_shift": 1})).eval()
    shifted.load_state_dict(plain.state_dict(), strict=False)
    input_ids = torch.randint(3, 300, (2, 50))
    torch.testing.assert_close(shifted(input_ids).logits, plain(input_ids).logits, atol=0, rtol=0)
    for layer in shifted.model.layers:
        torch.nn.init.normal_(layer.self_attn.k_shift)
        torch.nn.init.normal_(layer.self_attn.k_shift_wide)
        torch.nn.init.normal_(layer.self_attn.q_shift)
    shifted.save_pretrained(tmp_path)
    loaded = MiniMindForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.key_shift, loaded.config.query_shift) == (2, 1)
    torch.testing.assert_close(loaded(input_ids).logits, shifted(input_ids).logits, atol=0, rtol=0)
    assert (loaded(input_ids).logits - plain(input_ids).logits).abs().max() > 1e-3


def test_previous_inputs_in_chunks_equal_the_whole_sequence():
    """Token shift reads the j-th previous token's input, zeros before position 0, also across cache
    calls shorter than the shift (the cache carries the last tokens' inputs)."""
    x = torch.randn(2, 9, 3)
    whole = previous_inputs(x, None, None, None, 2)
    assert torch.equal(whole[0][:, 1:], x[:, :-1]) and not whole[0][:, 0].any()
    assert torch.equal(whole[1][:, 2:], x[:, :-2]) and not whole[1][:, :2].any()
    cache, pieces, start = KVBuffer(), [], 0
    for size in (1, 4, 1, 3):
        starts = torch.full((2,), start)
        pieces.append(previous_inputs(x[:, start : start + size], starts, starts + size, cache, 2))
        start += size
    for j in range(2):
        assert torch.equal(torch.cat([piece[j] for piece in pieces], dim=1), whole[j])


def test_old_configs_with_a_key_shift_switch_mean_one_token():
    assert MiniMindConfig(key_shift=True).key_shift == 1 and MiniMindConfig(key_shift=False).key_shift == 0
    with pytest.raises(ValueError, match="key_shift must be an integer in 0..4"):
        MiniMindConfig(key_shift=5)
    with pytest.raises(ValueError, match="query_shift must be an integer in 0..4"):
        MiniMindConfig(query_shift=-1)


@pytest.mark.parametrize("summary", ["bounds", "mean", "keys"])
def test_bounds_summary_finds_a_block_by_its_one_matching_key(summary):
    """The passkey situation: one key of a block matches the query, the block's other keys do not.
    Filler blocks all match a little. Bounds and keys rank the needle's block first; the mean,
    diluted by the 15 mismatching keys, ranks it last."""
    block_size, d, num_blocks, needle = 16, 8, 12, 5
    generator = torch.Generator().manual_seed(0)
    query = torch.nn.functional.normalize(torch.randn(d, generator=generator, dtype=torch.float64), dim=0)
    keys = 0.5 * query + 0.05 * torch.randn(num_blocks * block_size, d, generator=generator, dtype=torch.float64)
    keys[needle * block_size : (needle + 1) * block_size] -= query
    keys[needle * block_size + 7] = 3 * query
    summaries = retrieval.block_summaries(keys[None, None], 0, num_blocks, block_size, summary)
    selecting = retrieval.selection_queries(query.expand(1, 4, 1, d), 1, summary)
    block_ids, valid = exact_select(selecting, summaries, torch.tensor([[num_blocks]]), top_n=num_blocks)
    ranking = block_ids[0, 0, 0][valid[0, 0, 0]].tolist()
    assert ranking.index(needle) == (num_blocks - 1 if summary == "mean" else 0)


HOST_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


def count_host_reads(monkeypatch, call):
    """How many times call() reads a tensor back to the host (item, tolist, int(), bool(), ...)."""
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with torch.no_grad():
        call()
    monkeypatch.undo()
    return len(reads)


@pytest.mark.parametrize("cached", [False, True], ids=["training-pass", "prefill-and-decode"])
def test_host_reads_per_forward_do_not_grow_with_tiles_or_layers(monkeypatch, cached):
    """A forward reads the device back a few times at most, however many tiles (sequence length)
    and layers it runs: the loop's decisions come from host ints read once per call."""
    counts = {}
    for layers, length in [(1, 100), (3, 100), (1, 300), (3, 300)]:
        model = ann_model(num_hidden_layers=layers)
        ids = torch.randint(0, 300, (1, length), generator=torch.Generator().manual_seed(0))

        def forward():
            monkeypatch.setattr(ann_attention, "MASKED_SDPA_MAX_LEN", 0)
            monkeypatch.setattr(ann_attention, "QUERY_TILE", 32)  # length / 32 tiles per layer
            if not cached:
                model(ids)
                return
            out = model(ids, use_cache=True)
            model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)

        counts[layers, length] = count_host_reads(monkeypatch, forward)
    assert len(set(counts.values())) == 1, counts
    assert max(counts.values()) <= 6, counts


def test_logn_scale_is_one_up_to_its_length_then_the_log_ratio():
    positions = torch.tensor([[0, 510, 511, 1023, 262143]])
    expected = torch.tensor([[1.0, 1.0, 1.0, 10 / 9, 2.0]], dtype=torch.float64)  # ln(t+1)/ln(512) = log2(t+1)/9
    torch.testing.assert_close(ann_attention.logn_scale(positions, 512), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("summary", ["bounds", "keys"])
@pytest.mark.parametrize("block_position", ["capped", "true"])
def test_logn_length_scales_the_queries_past_it_and_selects_the_same_blocks(summary, block_position):
    """With ann_logn_length L the core's output equals the plain core's on queries scaled by
    logn_scale (outputs and gradients, float64): before L nothing changes, and since selection is
    linear in the query, the blocks each query retrieves stay those of the plain core."""
    plain = make_core(4, 2, window=8, block_size=4, top_n=2, block_position=block_position, summary=summary)
    scaled = make_core(4, 2, window=8, block_size=4, top_n=2, block_position=block_position, summary=summary,
                       ann_logn_length=24)
    q, k, v = random_qkv(2, 4, 2, 80)
    factor = ann_attention.logn_scale(torch.arange(80)[None], 24)[:, None, :, None]
    assert float(factor[0, 0, 23]) == 1.0 and float(factor[0, 0, 79]) > 1.3
    out = run(scaled, q, k, v)
    assert_same_outputs_and_gradients(out, run(plain, q * factor, k, v), (q, k, v))
    torch.testing.assert_close(out[:, :, :24], run(plain, q, k, v)[:, :, :24], atol=1e-12, rtol=0)
    reference = reference_attention(q * factor, k, v, 8, 4, 2, block_position, summary)
    torch.testing.assert_close(out, reference, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("retrieval", ["exact", "hnsw"])
def test_logn_model_full_forward_equals_chunked_prefill_and_decoding(retrieval):
    """Log-n scaling reads each query's own position: a whole-sequence forward, a chunked prefill
    and one-token decode steps agree; a layer that does not retrieve is not scaled."""
    model = ann_model(retrieval, ann_logn_length=32, ann_block_summary="keys", ann_retrieval_layers=[1])
    assert model.model.layers[1].self_attn.core.logn_length == 32
    assert model.model.layers[0].self_attn.core.logn_length is None
    input_ids = torch.randint(3, 300, (2, 120))
    full = model(input_ids).logits
    cache = model.new_cache()
    steps = [model(input_ids[:, :50], cache=cache, use_cache=True).logits]
    steps.append(model(input_ids[:, 50:70], cache=cache, use_cache=True).logits)
    for position in range(70, 120):
        steps.append(model(input_ids[:, position : position + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-4
    unscaled = ann_model(retrieval, ann_block_summary="keys", ann_retrieval_layers=[1])(input_ids).logits
    assert (unscaled[:, :32] - full[:, :32]).abs().max().item() <= 1e-5
    assert (unscaled[:, 32:] - full[:, 32:]).abs().max().item() > 1e-3


def reference_after_other_rows(q, k, v, window, block_size, top_n, summary, logn_length=None, kept=(), extra=0):
    """Unrotated q (b, h, s, d), k/v (b, g, s, d) -> out (b, h, s, d): row i's queries as the last s of
    one sequence made of the complete blocks of every other row (in row order) and then row i, by
    reference_attention (log-n scaled at their positions in that sequence). kept: earlier batches'
    (k, v), oldest first, whose complete blocks (row by row) come first in every row's sequence.
    extra N > 0: the top_n from the row's own blocks, and the N best of the blocks before it added."""
    b, h, s, d = q.shape
    length = s // block_size * block_size
    kept_k = [x[j, :, : x.shape[2] // block_size * block_size] for x, _ in kept for j in range(x.shape[0])]
    kept_v = [x[j, :, : x.shape[2] // block_size * block_size] for _, x in kept for j in range(x.shape[0])]
    rows = []
    for i in range(b):
        others = [j for j in range(b) if j != i]
        prefix_k = torch.cat(kept_k + [k[j, :, :length] for j in others], dim=1)
        prefix_v = torch.cat(kept_v + [v[j, :, :length] for j in others], dim=1)
        offset = prefix_k.shape[1]
        row_q = torch.cat([q.new_zeros(h, offset, d), q[i]], dim=1)[None]
        if logn_length is not None:
            row_q = row_q * ann_attention.logn_scale(torch.arange(offset + s)[None], logn_length)[:, None, :, None]
        out = reference_attention(row_q, torch.cat([prefix_k, k[i]], 1)[None], torch.cat([prefix_v, v[i]], 1)[None],
                                  window, block_size, top_n, "capped", summary, (offset // block_size, extra))
        rows.append(out[:, :, offset:])
    return torch.cat(rows)


@pytest.mark.parametrize("summary", ["bounds", "mean", "keys"])
@pytest.mark.parametrize("length", [4, 9, 40])
@pytest.mark.parametrize("heads,batch", [((4, 4), 2), ((4, 2), 3)], ids=["mha-b2", "gqa-b3"])
@pytest.mark.parametrize("top_n,logn_length", [(1, None), (3, None), (10_000, None), (2, 24)])
def test_batch_distractors_equal_each_row_after_the_other_rows_blocks(length, heads, batch, summary, top_n, logn_length):
    """ann_batch_distractors in training: each row's output and every gradient (including those
    flowing into the other rows' keys and values) equal the reference over the sequence [the other
    rows' complete blocks, the row] (float64)."""
    num_heads, kv_heads = heads
    core = make_core(num_heads, kv_heads, window=8, block_size=4, top_n=top_n, summary=summary,
                     ann_batch_distractors=True, ann_logn_length=logn_length)
    q, k, v = random_qkv(batch, num_heads, kv_heads, length, seed=length)
    out = run(core, q, k, v)
    expected = reference_after_other_rows(q, k, v, 8, 4, top_n, summary, logn_length)
    assert_same_outputs_and_gradients(out, expected, (q, k, v))
    alone = run(make_core(num_heads, kv_heads, window=8, block_size=4, top_n=top_n, summary=summary), q, k, v)
    assert (out - alone).abs().max().item() > 1e-3  # the other rows' blocks are taken


@pytest.mark.parametrize("summary", ["bounds", "keys"])
@pytest.mark.parametrize("memory", [1, 2])
@pytest.mark.parametrize("lengths", [(12, 12, 12, 12), (9, 16, 4, 13)], ids=["equal", "ragged"])
def test_distractor_memory_puts_earlier_batches_blocks_first_without_gradient(summary, memory, lengths):
    """With ann_distractor_memory M, batch n's rows follow the complete blocks of batches n-M .. n-1
    (oldest first, detached: no gradient reaches them) and then the other rows' blocks; outputs and
    gradients equal the reference over that sequence (float64); a checkpointed state restores it."""
    core = make_core(4, 2, window=8, block_size=4, top_n=2, summary=summary, ann_batch_distractors=True,
                     ann_distractor_memory=memory)
    batches = [random_qkv(3, 4, 2, length, seed=n) for n, length in enumerate(lengths)]
    for n, (q, k, v) in enumerate(batches):
        kept = [(earlier_k.detach(), earlier_v.detach()) for _, earlier_k, earlier_v in batches[max(0, n - memory) : n]]
        if n == 2:
            restored = make_core(4, 2, window=8, block_size=4, top_n=2, summary=summary, ann_batch_distractors=True,
                                 ann_distractor_memory=memory)
            restored.distractor_memory.load_state(core.distractor_memory.state(), q.device)
            torch.testing.assert_close(run(restored, q, k, v), run(core, q, k, v), atol=0, rtol=0)
            core = restored
            continue
        out = run(core, q, k, v)
        expected = reference_after_other_rows(q, k, v, 8, 4, 2, summary, kept=kept)
        assert_same_outputs_and_gradients(out, expected, (q, k, v))
        if n and any(x.shape[2] >= 4 for _, x, _ in batches[max(0, n - memory) : n]):
            assert (expected - reference_after_other_rows(q, k, v, 8, 4, 2, summary)).abs().max().item() > 1e-3


@pytest.mark.parametrize("summary", ["bounds", "keys"])
@pytest.mark.parametrize("length", [9, 40])
@pytest.mark.parametrize("top_n,extra", [(1, 1), (2, 3), (10_000, 2)])
@pytest.mark.parametrize("memory", [0, 1])
def test_distractor_blocks_add_the_best_foreign_blocks_to_a_rows_own_top_n(summary, length, top_n, extra, memory):
    """With ann_distractor_blocks N, each query attends its top_n among its own row's blocks (as
    without distractors) plus the N best foreign blocks (earlier batches' and the other rows'):
    outputs and gradients equal the reference that selects the two apart (float64)."""
    core = make_core(4, 2, window=8, block_size=4, top_n=top_n, summary=summary, ann_batch_distractors=True,
                     ann_distractor_memory=memory, ann_distractor_blocks=extra)
    earlier = random_qkv(3, 4, 2, 12, seed=1)
    if memory:
        run(core, *earlier)
    q, k, v = random_qkv(3, 4, 2, length, seed=length)
    out = run(core, q, k, v)
    kept = [(earlier[1].detach(), earlier[2].detach())] if memory else ()
    expected = reference_after_other_rows(q, k, v, 8, 4, top_n, summary, kept=kept, extra=extra)
    assert_same_outputs_and_gradients(out, expected, (q, k, v))
    competing = reference_after_other_rows(q, k, v, 8, 4, top_n, summary, kept=kept)
    assert (expected - competing).abs().max().item() > 1e-3  # not what all blocks competing select


def test_batch_distractors_act_only_in_a_training_pass_of_a_retrieving_layer():
    """Evaluation mode, a batch of one, a cached call and a layer that retrieves nothing are the
    plain model's; in training mode a batch's loss changes, and model.train()/eval() switch it."""
    model = ann_model(ann_batch_distractors=True, ann_retrieval_layers=[1])
    cores = [layer.self_attn.core for layer in model.model.layers]
    assert not any(core.training for core in cores)
    input_ids = torch.randint(3, 300, (2, 64))
    window_only = ann_model(ann_retrieval_layers=[1])
    window_only.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(input_ids).logits, window_only(input_ids).logits, atol=0, rtol=0)
    model.train()
    window_only.train()
    assert all(core.training for core in cores)
    distracted = model(input_ids).logits
    assert (distracted - window_only(input_ids).logits).abs().max().item() > 1e-3
    torch.testing.assert_close(model(input_ids[:1]).logits, window_only(input_ids[:1]).logits, atol=0, rtol=0)
    assert not cores[0].distracts(torch.zeros(2, 4, 64, 16), None, None)  # layer 0 retrieves nothing
    assert not cores[1].distracts(torch.zeros(2, 4, 64, 16), torch.zeros(2, dtype=torch.long), None)
    model.eval()
    assert not any(core.training for core in cores)
