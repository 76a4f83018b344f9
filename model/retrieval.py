"""Block retrieval for ANN attention: which earlier blocks of keys each query attends to.

Legend (as in model/ann_attention.py):
    b batch   g kv heads   s queries   d head dim   m blocks   n top_n

A block's summary is one vector per KV head, and a query scores the candidate blocks (see
`candidate_count`) by the inner product of its GQA group's selection vector with each summary and
keeps the best top_n (`selection_queries` and `block_summaries` below build both: [max key, min
key] against the split query, or mean key against the summed query). Retrieval is therefore plain maximum inner product
search, whatever the summary. The summary "keys" is no summary: a block scores the sum over the
group's heads of each head's largest q . k among the block's keys (what "bounds" upper-bounds),
so group queries are (b, g, s, r, d) and summaries the blocks' keys (b, g, m, B, d); exact retrieval
scores every candidate key, as dense attention's q . k does, and hnsw searches a graph over the keys
(KeyHnswRetriever) and scores only the blocks holding the keys it finds. Capped keys are
stored unrotated, so two blocks whose best key is the same token (with the same shifted tokens) tie
exactly; exact_select takes torch.topk's choice among tied scores.
Two retrievers give the same answer through one interface:

    retriever.select(group_queries (b, g, s, e), summaries (b, g, m, e), limits (b, s), top_n, bounds)
        -> block ids (b, g, s, n) long, valid (b, g, s, n) bool

`limits` is how many leading blocks are candidates for each query (0 .. m); slots past the
number of candidates are invalid, so a query never sees padding or a duplicated block. `bounds`
is (fewest, most) of the limits as host ints, known to the caller without reading the device
(QuerySpans); None reads them from `limits`.

    exact: one batched matmul and top-k in torch (training's default).
    hnsw:  (model/hnsw.py) a FAISS HNSW graph per (sequence, kv head) that grows block by block, in
           block order; a query with L candidates searches it when it holds exactly blocks 0 .. L-1.
           Per layer, its state lives in the KV cache so decoding only adds the new blocks. For
           "keys" the graph holds the blocks' keys, and the blocks of the keys found are re-scored.
    auto:  per query: exact while it has fewer candidates than a threshold, hnsw from there.
    pruned: (model/pruned_selection.py) exact's answer by branch and bound over super-block bounds,
           scoring few blocks where some stand out; in a KV cache the bounds grow with the blocks.

Every retriever is causal: a query's blocks depend only on the blocks that are candidates for it,
so neither later tokens nor the way a prefill is split into calls change them.
"""

from functools import lru_cache

import torch

from .hnsw import HnswRetriever, KeyHnswRetriever
from .pruned_selection import MIN_PRUNED_BLOCKS, SuperBlockBounds, pruned_select

NEG_INF = float("-inf")


def candidate_count(positions, window, block_size):
    """positions (b, s) -> number of candidate blocks (b, s): blocks j with j*B <= t - W."""
    return torch.div(positions - window, block_size, rounding_mode="floor").add(1).clamp(min=0)


def selection_queries(q, kv_heads, summary):
    """q (b, h, s, d) -> (b, g, s, e): the vector of each GQA group that scores its blocks.

    "mean": e = d, the group's summed queries. "bounds": e = 2d, [sum of max(q, 0), sum of min(q, 0)]
    over the group's heads, so that its product with a block's [max key, min key] is the sum over
    heads of each head's upper bound on q . k for any key of the block. "keys": the group's own
    queries, (b, g, s, r, d).
    """
    b, h, s, d = q.shape
    grouped = q.view(b, kv_heads, h // kv_heads, s, d)
    if summary == "keys":
        return grouped.transpose(2, 3)
    if summary == "mean":
        return grouped.sum(dim=2)
    low, high = split_limits(d, q.dtype, q.device)
    return torch.cat([grouped, grouped], dim=-1).clamp_(min=low, max=high).sum(dim=2)


@lru_cache(maxsize=None)
def split_limits(head_dim, dtype, device):
    """Clamp limits (2d,) that turn [q, q] into [max(q, 0), min(q, 0)] in one kernel: the bounds
    selection vector costs three kernels instead of five (a decoding step's selection is that small)."""
    inf = torch.full((head_dim,), float("inf"), dtype=dtype, device=device)
    zero = torch.zeros(head_dim, dtype=dtype, device=device)
    return torch.cat([zero, -inf]), torch.cat([inf, zero])


def block_summaries(keys, first_block, end_block, block_size, summary):
    """keys (b, g, t, d) -> summaries (b, g, end_block - first_block, e) of blocks first .. end-1.

    "mean": e = d, the mean key. "bounds": e = 2d, the channel-wise [max, min] of the block's keys
    (Quest): a block with one key that matches the query scores high however ordinary the rest is,
    where a mean dilutes that key by the B-1 others. "keys": the block's keys themselves,
    (b, g, m, B, d), a view when `keys` is contiguous.
    """
    b, g, _, d = keys.shape
    span = keys[:, :, first_block * block_size : end_block * block_size]
    blocks = span.reshape(b, g, end_block - first_block, block_size, d)
    if summary == "keys":
        return blocks
    if summary == "mean":
        return blocks.mean(dim=3)
    return torch.cat([blocks.amax(dim=3), blocks.amin(dim=3)], dim=-1)


def pad_selection(block_ids, valid, top_n):
    """Pad (b, g, s, k<=n) selections to n slots with invalid entries."""
    missing = top_n - block_ids.shape[-1]
    if missing <= 0:
        return block_ids, valid
    block_ids = torch.nn.functional.pad(block_ids, (0, missing))
    valid = torch.nn.functional.pad(valid, (0, missing), value=False)
    return block_ids, valid


def limit_bounds(limits, bounds):
    """bounds, or (fewest, most) of limits (b, s) read from the device when bounds is None."""
    if bounds is not None:
        return bounds
    if not limits.numel():
        return 0, 0
    fewest, most = torch.aminmax(limits)
    return int(fewest), int(most)


KEYS_PER_SCORING_STEP = 1 << 13


def summary_scores(group_queries, summaries):
    """group_queries (b, g, s, e), summaries (b, g, m, e) -> scores (b, g, s, m): inner products; or
    for "keys", (b, g, s, r, d) and (b, g, m, B, d) -> the sum over r of the largest q . k over B,
    KEYS_PER_SCORING_STEP keys at a time so that the (s, r, keys) products stay small."""
    summaries = summaries.to(group_queries.dtype)
    if summaries.dim() == 4:
        return group_queries @ summaries.transpose(-1, -2)
    block_size = summaries.shape[3]
    parts = [group_queries.new_zeros(*group_queries.shape[:3], 0)]
    for part in summaries.split(max(1, KEYS_PER_SCORING_STEP // block_size), dim=2):
        products = torch.einsum("bgsrd,bgkd->bgsrk", group_queries, part.flatten(2, 3))
        parts.append(products.unflatten(-1, (part.shape[2], block_size)).amax(dim=-1).sum(dim=3))
    return torch.cat(parts, dim=-1)


def candidate_scores(group_queries, summaries, limits, bounds=None):
    """group_queries (b, g, s, e), summaries (b, g, m, e), limits (b, s) -> scores (b, g, s, m'), m' <= m.

    Each query's score of every block, -inf past its `limits` candidates; only the m' leading
    blocks that some query has as candidates are scored. bounds: see limit_bounds.
    """
    fewest, most = limit_bounds(limits, bounds)
    m = min(most, summaries.shape[2])
    scores = summary_scores(group_queries, summaries[:, :, :m])
    # Every query has its first limits.min() blocks as candidates: only the columns past them need
    # masking, in place (a fresh matmul output, the largest tensor here).
    first_masked = min(fewest, m)
    if first_masked < m:
        is_candidate = torch.arange(first_masked, m, device=scores.device)[None, None, :] < limits[:, :, None]
        scores[..., first_masked:].masked_fill_(~is_candidate[:, None], NEG_INF)
    return scores


def exact_select(group_queries, summaries, limits, top_n, bounds=None):
    """Exact top-n candidate blocks per query by inner product.

    group_queries (b, g, s, d), summaries (b, g, m, d), limits (b, s), bounds: see limit_bounds
    -> ids, valid (b, g, s, n).
    """
    fewest, most = limit_bounds(limits, bounds)
    m = min(most, summaries.shape[2])
    if m == 0 or top_n == 0:
        empty = group_queries.new_zeros(*group_queries.shape[:3], top_n, dtype=torch.long)
        return empty, empty.bool()
    top_scores, block_ids = candidate_scores(group_queries, summaries, limits, (fewest, most)).topk(min(top_n, m), dim=-1)
    return pad_selection(block_ids, top_scores > NEG_INF, top_n)


class ExactRetriever:
    def select(self, group_queries, summaries, limits, top_n, bounds=None):
        return exact_select(group_queries, summaries, limits, top_n, bounds)

    def summaries_changed(self, first_block):
        """The KV cache recomputed the summaries of blocks first_block on: nothing is kept of them here."""


class PrunedRetriever(ExactRetriever):
    """exact_select's answer from pruned_select. Its super-block bounds are kept between calls and
    extended over new blocks and over the blocks the cache reports changed (summaries_changed), so
    a decoding step recomputes only the nodes above its newest block. Below min_blocks
    candidates it is exact_select, without bounds. `stats` sums pruned_select's counts over the
    calls that pruned (what a benchmark reports)."""

    min_blocks = MIN_PRUNED_BLOCKS

    def __init__(self):
        self.super_bounds = None
        self.first_changed = 0
        self.stats = {}

    def summaries_changed(self, first_block):
        self.first_changed = min(self.first_changed, first_block)

    def select(self, group_queries, summaries, limits, top_n, bounds=None):
        fewest, most = limit_bounds(limits, bounds)
        if min(most, summaries.shape[2]) < self.min_blocks:
            return exact_select(group_queries, summaries, limits, top_n, (fewest, most))
        m = summaries.shape[2]
        if self.super_bounds is None or m < self.super_bounds.num_blocks:
            self.super_bounds = SuperBlockBounds()
            self.first_changed = 0
        self.super_bounds.extend(summaries, first_changed=self.first_changed)
        self.first_changed = m
        return pruned_select(group_queries, summaries, limits, top_n, self.super_bounds, self.stats,
                             min_blocks=self.min_blocks)


class AutoRetriever(ExactRetriever):
    """Exact scoring for a query with fewer than `threshold` candidates, HNSW for one with more.

    The choice is each query's own (its limit), never the call's: a call's largest limit depends on
    how a prefill was chunked and on later queries.
    """

    def __init__(self, threshold, hnsw):
        self.threshold = threshold
        self.hnsw = hnsw

    def select(self, group_queries, summaries, limits, top_n, bounds=None):
        fewest, most = limit_bounds(limits, bounds)
        if most < self.threshold:
            return exact_select(group_queries, summaries, limits, top_n, (fewest, most))
        if fewest >= self.threshold:
            return self.hnsw.select(group_queries, summaries, limits, top_n)
        far = limits >= self.threshold  # (b, s)
        # A limit of 0 gives a query no blocks: each retriever sees only its own queries.
        exact_ids, exact_valid = exact_select(
            group_queries, summaries, limits.masked_fill(far, 0), top_n, (0, min(most, self.threshold - 1))
        )
        hnsw_ids, hnsw_valid = self.hnsw.select(group_queries, summaries, limits.masked_fill(~far, 0), top_n)
        far = far[:, None, :, None]
        return torch.where(far, hnsw_ids, exact_ids), torch.where(far, hnsw_valid, exact_valid)


class OwnAndForeignRetriever:
    """A cross-batch distractor pass's selection with ann_distractor_blocks N: the leading
    `foreign_blocks` candidates are other sequences' blocks, the rest a query's own. The top_n come
    from its own candidates alone and the N best foreign blocks are added after them, so a
    distractor never displaces the block the query must copy from, and the blocks beside it are
    the best of all the foreign ones. -> ids, valid (b, g, s, top_n + N)."""

    def __init__(self, own, foreign, foreign_blocks, extra):
        self.own, self.foreign = own, foreign
        self.foreign_blocks, self.extra = foreign_blocks, extra

    def select(self, group_queries, summaries, limits, top_n, bounds=None):
        fewest, most = limit_bounds(limits, bounds)
        split = self.foreign_blocks
        own_ids, own_valid = self.own.select(
            group_queries, summaries[:, :, split:], (limits - split).clamp(min=0), top_n,
            (max(fewest - split, 0), max(most - split, 0)),
        )
        foreign_ids, foreign_valid = self.foreign.select(
            group_queries, summaries[:, :, :split], limits.clamp(max=split), self.extra,
            (min(fewest, split), min(most, split)),
        )
        return torch.cat([own_ids + split, foreign_ids], dim=-1), torch.cat([own_valid, foreign_valid], dim=-1)


def build_hnsw_retriever(config):
    """The HNSW retriever of config's summary: over keys for "keys", else over block summaries."""
    hnsw_settings = (config.hnsw_m, config.hnsw_ef_construction, config.hnsw_ef_search)
    if config.ann_block_summary == "keys":
        return KeyHnswRetriever(config.ann_block_size, config.hnsw_keys_per_head, *hnsw_settings)
    return HnswRetriever(*hnsw_settings)


def build_retriever(config, kind=None):
    kind = kind or config.ann_retrieval
    if kind == "exact":
        return ExactRetriever()
    if kind == "hnsw":
        return build_hnsw_retriever(config)
    if kind == "auto":
        return AutoRetriever(config.ann_auto_threshold, build_hnsw_retriever(config))
    if kind == "pruned":
        return PrunedRetriever()
    raise ValueError(f"unknown retrieval {kind!r}; choose exact, hnsw, auto or pruned")
