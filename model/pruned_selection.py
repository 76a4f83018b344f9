"""Exact top-n block selection that scores few blocks: branch and bound over super-block bounds.

Legend (as in model/ann_attention.py):
    b batch   g kv heads   s queries   e summary size   m blocks   n top_n
    H = b*g   G query groups of Q consecutive queries   S blocks (or nodes) per super-block
    c columns of a level's rows (e for block summaries, up to 2e for bounds)

Same interface and answer as model/retrieval.py's exact_select (a block's score is the inner product
of the GQA group's selection vector x with its summary; only the first limits[b, s] blocks are
candidates), without scoring every candidate. The bound: a super-block's rows are the channel-wise
max hi and min lo of its blocks' summaries, and for any x and any block j inside it

    x . summary_j <= sum_c max(x_c * hi_c, x_c * lo_c) = relu(x) . hi + min(x, 0) . lo,

whatever the summary kind. Levels stack: a level-2 node bounds S2 level-1 nodes, and so on. One call:
    1. the top level's bounds for every query (one matmul over few rows);
    2. seed: queries go in groups of Q; level by level, a group keeps the union of its queries'
       `seed_width` best nodes and scores their children for all its queries with one matmul, down
       to exact scores of a few blocks; a query's n-th best of those is its threshold tau (-inf
       with fewer than n candidates there);
    3. descent: queries are regrouped by their best seed block, so that a group's queries seek
       alike; a group keeps the union of its queries' surviving nodes (bound >= tau), scores their
       children the same way, and so on down to exact block scores; top-n of those.
A node whose blocks are only partly candidates keeps its bound (still an upper bound); a node with
no candidate block is dropped, and a non-candidate block is masked at exact scoring. Where a
group's surviving children would be a large part of a level, the level is scored whole instead
(one matmul, no gather), or, where that would cost more than it can save, the blocks are scored
whole at once: on keys whose bounds prune nothing (e.g. i.i.d. random, where a super-block's max
over S*B keys is far above any block's score) a call costs exact scoring plus the top levels and
the seed. Gathered rows cost far more per score than one large matmul, so pruning pays only where
it leaves a small fraction of the blocks (benchmarks/bench_selection.py measures where).

Rounding: a node survives unless its bound is below tau by more than the float rounding of a
bound and a score could account for (`rounding_margin`), so a block that could be in the exact
top-n is always scored. Ties: between blocks whose scores are equal to within rounding, either
may be chosen (as between exact_select on two machines).

Decoding keeps a `SuperBlockBounds` next to the summaries and extends it as blocks complete;
pruned_select takes it as `bounds` so that nothing is recomputed per token.
"""

import torch

from .kv_cache import with_capacity

NEG_INF = float("-inf")
DEFAULT_GROUP_SIZES = (8, 8, 8)
DEFAULT_QUERY_GROUP = 32
# Below this many candidate blocks one matmul over all of them is cheaper than any pruning.
MIN_PRUNED_BLOCKS = 1024
# A group whose surviving children are at least this fraction of a level scores the whole level
# (no gather, and the gathers never outgrow the score matrix that exact scoring would build) ...
DENSE_FRACTION = 0.25
# ... and the whole level only where that costs at most this fraction of scoring every block.
DENSE_LEVEL_COST = 1 / 8
# Elements a chunk of query groups may gather, at least (a bound on the call's working memory).
GATHER_BUDGET = 1 << 24


def group_bounds(hi, lo, size):
    """hi/lo (b, g, k, c) -> (hi, lo) (b, g, ceil(k / size), c): max and min over runs of `size` rows."""
    full = hi.shape[2] // size * size
    his, los = [], []
    if full:
        his.append(hi[:, :, :full].unflatten(2, (-1, size)).amax(3))
        los.append(lo[:, :, :full].unflatten(2, (-1, size)).amin(3))
    if full < hi.shape[2]:
        his.append(hi[:, :, full:].amax(2, keepdim=True))
        los.append(lo[:, :, full:].amin(2, keepdim=True))
    return torch.cat(his, dim=2), torch.cat(los, dim=2)


class SuperBlockBounds:
    """Super-block bounds of a growing sequence of block summaries, level by level.

    Level 1 node i covers blocks [i*S1, (i+1)*S1); a level-L node covers S_L nodes of level L-1; the
    last node of a level may be partial. Each level is stored as rows [hi, lo] (b, g, nodes, 2e) in
    a buffer that grows by doubling. `extend` recomputes only the nodes over changed or new blocks.
    """

    def __init__(self, group_sizes=DEFAULT_GROUP_SIZES):
        if not group_sizes or any(int(size) < 2 for size in group_sizes):
            raise ValueError(f"SuperBlockBounds: group sizes must be integers >= 2, got {tuple(group_sizes)}")
        self.group_sizes = tuple(int(size) for size in group_sizes)
        self.num_blocks = 0
        self.node_counts = [0] * len(self.group_sizes)
        self.buffers = [None] * len(self.group_sizes)
        self.selected = {}  # (columns, dtype) -> rows of each level, until the next extend

    @classmethod
    def of(cls, summaries, group_sizes=DEFAULT_GROUP_SIZES):
        """The bounds of summaries (b, g, m, e), computed at once."""
        return cls(group_sizes).extend(summaries)

    def extend(self, summaries, first_changed=None):
        """Cover summaries (b, g, m, e), every block so far; returns self.

        Blocks before first_changed (default: the blocks covered already) must be unchanged since the
        last call; the nodes over the others, and over the new blocks, are recomputed.
        """
        m = summaries.shape[2]
        first = self.num_blocks if first_changed is None else min(int(first_changed), self.num_blocks)
        if m < self.num_blocks:
            raise ValueError(f"SuperBlockBounds.extend: {m} summaries, fewer than the {self.num_blocks} covered already")
        if first >= m:  # nothing new and nothing changed (a decoding step inside a block)
            return self
        hi = lo = summaries
        count = m
        for level, size in enumerate(self.group_sizes):
            first_node = first // size
            node_count = -(-count // size)
            fresh_hi, fresh_lo = group_bounds(hi[:, :, first_node * size : count], lo[:, :, first_node * size : count], size)
            fresh = torch.cat([fresh_hi, fresh_lo], dim=-1)
            buffer = with_capacity(self.buffers[level], fresh, node_count)
            buffer[:, :, first_node:node_count] = fresh
            self.buffers[level] = buffer
            self.node_counts[level] = node_count
            rows = buffer[:, :, :node_count]
            half = rows.shape[-1] // 2
            hi, lo, first, count = rows[..., :half], rows[..., half:], first_node, node_count
        self.num_blocks = m
        self.selected = {}
        return self

    def levels(self):
        """[(rows (b, g, nodes, 2e), blocks per node)] from level 1 up."""
        spans, span = [], 1
        for size in self.group_sizes:
            span *= size
            spans.append(span)
        return [(buffer[:, :, :count], span) for buffer, count, span in zip(self.buffers, self.node_counts, spans)]

    def level_rows(self, columns, dtype):
        """[rows (b*g, nodes, len(columns))] from level 1 up: the columns (of [hi, lo]) that a call's
        queries use, in dtype. Kept until the next extend: the tiles of a prefill share them."""
        key = (tuple(columns.tolist()), dtype)
        if key not in self.selected:
            self.selected[key] = [
                head_rows(rows.index_select(-1, columns).to(dtype)) for rows, _ in self.levels()
            ]
        return self.selected[key]


def head_rows(tensor):
    """(b, g, R, c) -> (b*g, R, c), without a copy where the tensor is a slice along R of a buffer."""
    b, g, R, c = tensor.shape
    if tensor.stride(3) == 1 and tensor.stride(2) == c and tensor.stride(0) == g * tensor.stride(1):
        return tensor.as_strided((b * g, R, c), (tensor.stride(1), c, 1))
    return tensor.reshape(b * g, R, c)


def gather_rows(rows, ids):
    """rows (H, R, c), ids (H, ...) in [0, R) -> (H, ..., c): one index_select per head (views)."""
    flat = ids.reshape(ids.shape[0], -1)
    gathered = rows.new_empty(*flat.shape, rows.shape[-1])
    for head in range(rows.shape[0]):
        torch.index_select(rows[head], 0, flat[head], out=gathered[head])
    return gathered.view(*ids.shape, rows.shape[-1])


def rounding_margin(x, level_rows, dtype):
    """x (H, s, e), level_rows (H, k, 2e) of a level -> (H, s, 1): how far below a block's
    computed score its node's computed bound can fall through rounding alone.

    Both are sums of at most 2e products, each no larger than |x_c| * max|summary_c|; a sum of k
    terms in floating point is off by at most k * eps/2 times the sum of their magnitudes.
    """
    e = x.shape[-1]
    largest = level_rows.abs().amax(dim=1)  # (H, 2e)
    largest = torch.maximum(largest[:, :e], largest[:, e:])
    magnitude = x.abs() @ largest[:, :, None].to(x.dtype)
    return magnitude * (3 * e * torch.finfo(dtype).eps)


def scored_nodes(vectors, rows, parents, size, span, limits):
    """Scores of one level's nodes (or blocks) for every query, those with no candidate block at -inf.

    vectors (H, G, Q, c); rows (H, R, c), one per node; span: blocks per node; limits (H, G, Q);
    parents None: every row, by one matmul; else (H, G, 1, U) node ids of the level above shared by
    the group's Q queries, -1 for none, whose `size` children are gathered and scored
    -> ids (H|1, G|1, 1, C) with -1 for none, scores (H, G, Q, C).
    """
    H, G, Q, c = vectors.shape
    R = rows.shape[1]
    if parents is None:
        ids = torch.arange(R, device=rows.device).view(1, 1, 1, R)
        scores = (vectors.reshape(H, G * Q, c) @ rows.transpose(1, 2)).view(H, G, Q, R)
        # Every query has candidates in the nodes before the smallest limit's: mask the rest only.
        first = min(R, -(-int(limits.min()) // span))
        if first < R:
            no_candidate = ids[..., first:] * span >= limits[..., None]
            scores[..., first:].masked_fill_(no_candidate, NEG_INF)
        return ids, scores
    ids = (parents[..., None] * size + torch.arange(size, device=parents.device)).flatten(-2)
    ids = ids.masked_fill((parents < 0).repeat_interleave(size, dim=-1) | (ids >= R), -1)
    gathered = gather_rows(rows, ids.clamp(min=0))
    scores = vectors @ gathered[:, :, 0].transpose(-1, -2)
    no_candidate = (ids < 0) | (ids * span >= limits[..., None])
    return ids, scores.masked_fill_(no_candidate, NEG_INF)


def count_scores(stats, span, scores):
    """Add a level's query-node scores to stats: exact block scores at span 1, else bounds."""
    if stats is not None:
        key = "exact_scores" if span == 1 else "bound_scores"
        stats[key] = stats.get(key, 0) + scores.numel()


def union_parents(ids, alive):
    """The nodes that any query of a group keeps, in id order.

    ids (H|1, G|1, 1, C), alive (H, G, Q, C) -> (H, G, 1, U) with -1 for none, U the largest group's count.
    """
    alive = alive.any(dim=2, keepdim=True)
    slots = alive.cumsum(dim=-1) - 1
    count = int(slots[..., -1].max()) + 1
    # Survivors go to their slot, the others to one spare column dropped after.
    parents = torch.full((*alive.shape[:3], count + 1), -1, dtype=torch.long, device=alive.device)
    parents.scatter_(-1, slots.masked_fill(~alive, count), ids.expand(*alive.shape))
    return parents[..., :count]


def walk(steps, top_scores, limits, keep, stats, jump_to_blocks):
    """From the top level down to block scores, for query groups: each level scores, for all Q
    queries of a group, the children of the nodes that any of them keeps; the whole level where
    those would be most of it, or (jump_to_blocks) straight the blocks where even that would cost
    more than it can save.

    steps as in pruned_select with vectors (H, G, Q, c); top_scores (H, G, Q, R_top); limits
    (H, G, Q); keep: scores (H, G, Q, C) -> the nodes each query keeps (bool, same shape)
    -> block ids (H|1, G|1, 1, C), scores (H, G, Q, C) with non-candidates at -inf, and whether
    every block was scored.
    """
    ids = torch.arange(top_scores.shape[-1], device=top_scores.device).view(1, 1, 1, -1)
    scores = top_scores
    for vectors, rows, span, size in steps[1:]:
        parents = union_parents(ids, keep(scores) & (scores > NEG_INF))
        if parents.shape[-1] * size >= DENSE_FRACTION * rows.shape[1]:
            parents = None
            blocks = steps[-1][1]
            if jump_to_blocks and rows.shape[1] * rows.shape[2] > DENSE_LEVEL_COST * blocks.shape[1] * blocks.shape[2]:
                vectors, rows, span, size = steps[-1]
        ids, scores = scored_nodes(vectors, rows, parents, size, span, limits)
        count_scores(stats, span, scores)
        if span == 1:
            break
    return ids, scores, parents is None


def in_best(width):
    """keep for walk: each query's `width` best nodes (and any tied with the last)."""
    def keep(scores):
        return scores >= scores.topk(min(width, scores.shape[-1]), dim=-1).values[..., -1:]
    return keep


def at_least(floor):
    """keep for walk: the nodes whose score reaches the query's floor (H, G, Q, 1)."""
    return lambda scores: scores >= floor


def best_blocks(ids, scores, count):
    """Each query's `count` best blocks, -inf padded: ids (H|1, G|1, 1|Q, C), scores (H, G, Q, C)
    -> values, ids (H, G, Q, count)."""
    top = scores.topk(min(count, scores.shape[-1]), dim=-1)
    missing = count - top.values.shape[-1]
    values = torch.nn.functional.pad(top.values, (0, missing), value=NEG_INF)
    return values, torch.nn.functional.pad(ids.expand(*scores.shape).gather(-1, top.indices), (0, missing))


def selection(values, ids, shape):
    """Best values and ids (any shape with b*g*s*n elements) -> ids, valid (b, g, s, n) as
    exact_select returns them; invalid slots point at block 0, a real row for whoever gathers by id."""
    valid = (values > NEG_INF).reshape(shape)
    return ids.reshape(shape).masked_fill(~valid, 0), valid


def query_chunks(count, per_item, budget):
    """Slices of range(count) with per_item * length <= budget (at least one item each)."""
    step = max(1, int(budget // max(per_item, 1)))
    return [slice(first, min(first + step, count)) for first in range(0, count, step)]


def pruned_select(group_queries, summaries, limits, top_n, bounds=None, stats=None, query_group=DEFAULT_QUERY_GROUP,
                  seed_width=None, group_sizes=DEFAULT_GROUP_SIZES, min_blocks=MIN_PRUNED_BLOCKS):
    """Exact top-n candidate blocks per query by inner product, as exact_select, by branch and bound.

    group_queries (b, g, s, e), summaries (b, g, m, e), limits (b, s) -> ids, valid (b, g, s, n).
    bounds: a SuperBlockBounds of exactly these summaries (decoding keeps one), else built here with
    group_sizes. stats: a dict that gains counts of query-node bound scores ("bound_scores"),
    query-block exact scores ("exact_scores", seed and padding included) and the query-block
    scores exact_select computes ("dense_scores"). query_group: Q. seed_width: nodes per query and
    level in the seed, default top_n (the n best blocks may lie in n different nodes). With fewer
    than min_blocks candidates every candidate is scored.
    """
    b, g, s, e = group_queries.shape
    m = min(int(limits.max()), summaries.shape[2]) if limits.numel() else 0
    if m == 0 or top_n == 0:
        empty = group_queries.new_zeros(b, g, s, top_n, dtype=torch.long)
        return empty, empty.bool()
    if bounds is not None and bounds.num_blocks != summaries.shape[2]:
        raise ValueError(f"pruned_select: bounds cover {bounds.num_blocks} blocks, summaries have {summaries.shape[2]}")
    if stats is not None:
        stats["dense_scores"] = stats.get("dense_scores", 0) + b * g * s * m
    dtype, H = group_queries.dtype, b * g
    x = group_queries.reshape(H, s, e)
    query_limits = limits[:, None].expand(b, g, s).reshape(H, s)
    blocks = head_rows(summaries[:, :, :m].to(dtype))
    if m < min_blocks:
        ids, scores = scored_nodes(x.view(H, 1, s, e), blocks, None, None, 1, query_limits.view(H, 1, s))
        count_scores(stats, 1, scores)
        return selection(*best_blocks(ids, scores, top_n), (b, g, s, top_n))
    bounds = bounds or SuperBlockBounds.of(summaries[:, :, :m], group_sizes)
    seed_width = seed_width or top_n
    bound_x = torch.cat([x.clamp(min=0), x.clamp(max=0)], dim=-1)
    # Channels where no query has a positive (or a negative) part add nothing to a bound: for
    # "bounds" summaries that is half of them.
    active = (bound_x != 0).any(dim=1).any(dim=0).nonzero().flatten()
    bound_x = bound_x.index_select(-1, active)
    # Levels above the first with a single node over the candidates would only cost a bound.
    spans = [span for _, span in bounds.levels()]
    used = [i for i, span in enumerate(spans) if i == 0 or span < m]
    level_rows = bounds.level_rows(active, dtype)
    top_rows, _ = bounds.levels()[used[-1]]
    margin = rounding_margin(x, head_rows(top_rows[:, :, : -(-m // spans[used[-1]])]).to(dtype), dtype)
    # From the top level down to the blocks: (vectors, rows, span, children per node of the step above).
    # Each level cut to the nodes that hold blocks below m.
    steps = [
        (bound_x, level_rows[i][:, : -(-m // spans[i])], spans[i], None if i == used[-1] else bounds.group_sizes[i + 1])
        for i in reversed(used)
    ]
    steps.append((x, blocks, 1, bounds.group_sizes[0]))
    _, top_scores = scored_nodes(bound_x.view(H, 1, s, -1), steps[0][1], None, None, steps[0][2], query_limits.view(H, 1, s))
    top_scores = top_scores.view(H, s, -1)
    count_scores(stats, steps[0][2], top_scores)
    Q = min(query_group, s)
    G = -(-s // Q)

    def grouped(tensor, order, fill):
        """(H, s, ...) in query order (None: as given), padded with `fill` to (H, G, Q, ...).
        Padding queries have no candidates: they add nothing to their group's unions."""
        if order is not None:
            tensor = tensor.gather(1, order.view(H, s, *[1] * (tensor.dim() - 2)).expand_as(tensor))
        padding = tensor.new_full((H, G * Q - s, *tensor.shape[2:]), fill)
        return torch.cat([tensor, padding], dim=1).view(H, G, Q, *tensor.shape[2:])

    def walk_groups(order, keep_for, jump_to_blocks):
        """walk over the query groups of `order`, in chunks that keep gathers within budget;
        keep_for(part) -> keep -> [(ids, scores)] per chunk, and the grouped limits."""
        group_steps = [(grouped(vectors, order, 0), rows, span, size) for vectors, rows, span, size in steps]
        group_top, group_limits = grouped(top_scores, order, NEG_INF), grouped(query_limits, order, 0)
        return [
            walk(
                [(vectors[:, part], rows, span, size) for vectors, rows, span, size in group_steps],
                group_top[:, part], group_limits[:, part], keep_for(part), stats, jump_to_blocks,
            )
            for part in query_chunks(G, H * DENSE_FRACTION * m * e, max(GATHER_BUDGET, H * s * m))
        ]

    def ungrouped(chunks, order):
        """Per-chunk (H, g, Q, n) results -> (H, s, n) in the callers' query order."""
        joined = torch.cat(chunks, dim=1).flatten(1, 2)[:, :s]
        if order is None:
            return joined
        return joined.gather(1, order.argsort(dim=1)[..., None].expand_as(joined))

    # Seed: each query's tau is the n-th best exact score over the blocks that its group reaches by
    # keeping each query's seed_width best nodes per level.
    walks = walk_groups(None, lambda part: in_best(seed_width), False)
    seeds = [best_blocks(ids, scores, top_n) for ids, scores, _ in walks]
    seed_values, seed_ids = (ungrouped(parts, None) for parts in zip(*seeds))
    if all(whole for _, _, whole in walks):
        # Each group's seed reached so many blocks that it scored them all: that is the answer.
        return selection(seed_values, seed_ids, (b, g, s, top_n))
    tau, best_block = seed_values[..., -1:], seed_ids[..., 0]
    # Queries that seek the same blocks go in one group, so that the groups' unions stay small.
    order = best_block.masked_fill(seed_values[..., 0] == NEG_INF, -1).argsort(dim=1, stable=True)
    floor = grouped(tau - margin, order, NEG_INF)
    results = [best_blocks(ids, scores, top_n) for ids, scores, _ in walk_groups(order, lambda part: at_least(floor[:, part]), True)]
    values = ungrouped([values for values, _ in results], order)
    return selection(values, ungrouped([ids for _, ids in results], order), (b, g, s, top_n))
