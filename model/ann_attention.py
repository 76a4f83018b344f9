"""ANN attention: each query attends to a sliding window of recent keys plus the top-n most
relevant earlier blocks of keys.

Legend of dimension letters:
    b batch            h query heads        g kv heads         r = h / g, query heads per kv head
    s new queries      t keys (positions)   d head dim         m blocks
    e summary size (2d for bounds, d for mean)
    T queries per tile n top_n              B block size       W window (a multiple of B)

Definition (one semantics for training, prefill and decoding). Block j holds positions
[j*B, (j+1)*B), aligned to each sequence's position 0. For a query at position t:
    window keys:      positions max(0, t-W+1) .. t;
    candidate blocks: j with j*B <= t-W (complete, past, holding a key older than the window);
    selection:        the top_n candidates by score_j, chosen per token and per kv head
                      (model/retrieval.py). With ann_block_summary "bounds" (the default, Quest's),
                      score_j = sum over the GQA group's heads and channels c of
                      max(q_c * max_c, q_c * min_c), the max/min over block j's keys: an upper
                      bound of the head's largest q . k in the block. With "mean" it is
                      (sum of the group's queries) . (mean key of block j);
    attended keys:    the window plus the selected blocks' positions <= t-W, under one softmax per
                      query head. No key counts twice, and missing candidates are just missing.
    positions:        window keys are rotated (RoPE) at their true distance from the query. Retrieved
                      keys, with ann_block_position "capped" (the default), all sit at the distance
                      W + (t mod W): just beyond the window, inside the distances training covers at
                      any context length; summaries and selection use the same frame, so which block
                      wins does not depend on how far back it lies. With "true" they keep their real
                      distance, and when top_n covers every candidate this is dense causal attention.
The t mod W (rather than a constant W) lets the W queries of an aligned chunk share one copy of the
retrieved keys rotated to their frame, so training runs fused SDPA per chunk (docs/LONG_CONTEXT.md).

Cost. Queries are processed in tiles of T: a tile's window is one slab of T+W-1 keys and each
query gathers its n*B block keys, so memory is O(T*(T+W+n*B)) per tile and O(s*(W+n*B)) in all,
never O(s*t). Decoding one token costs O(W + n*B) attention plus one retrieval.
"""

import math

import torch
import torch.nn.functional as F

from .dense_attention import dense_attention
from .kv_cache import KVBuffer, with_capacity
from .retrieval import block_summaries, build_retriever, candidate_count, selection_queries

NEG_INF = float("-inf")
QUERY_TILE = 256
# Up to this many queries from position 0, the selection becomes a boolean mask for SDPA's fused
# kernel: no per-query key copies, but O(s^2) work. Beyond it the tiles win (forward + backward,
# 1 thread, 8/2 heads, d 64: masked 37 ms vs tiled 78 ms at 512, 203 vs 208 at 1024, 846 vs 304
# at 2048; docs/BENCHMARKS.md).
MASKED_SDPA_MAX_LEN = 1024


def window_slab(keys, values, first_positions, num_queries, window):
    """The keys that any of num_queries consecutive queries can see in its window.

    keys/values (b, g, t, d), first_positions (b,) = position of the first query
    -> slab keys/values (b, g, s+W, d) and slab positions (b, s+W), from W-1 before the first
    query to one past the last (that key is never visible; it makes the slab split into chunks).
    Positions outside [0, t) are clamped here and masked by the caller.
    """
    b, g, t, d = keys.shape
    length = num_queries + window
    positions = first_positions[:, None] - (window - 1) + torch.arange(length, device=keys.device)
    begin = int(positions[0, 0])
    if bool((first_positions == first_positions[0]).all()) and begin >= 0 and begin + length <= t:
        return keys[:, :, begin : begin + length], values[:, :, begin : begin + length], positions
    index = positions.clamp(0, t - 1)[:, None, :, None].expand(b, g, -1, d)
    return keys.gather(2, index), values.gather(2, index), positions


def chunk_slab(slab, num_chunks, window):
    """slab (..., s+W, x) with s = num_chunks * C -> (..., c, C+W, x): the keys chunk i can see.

    One chunk (C <= W) sees the whole slab; with C = W, chunk i sees slab pieces i and i+1.
    """
    if num_chunks == 1:
        return slab.unsqueeze(-3)
    pieces = slab.unflatten(-2, (num_chunks + 1, window))
    return torch.cat([pieces[..., :-1, :, :], pieces[..., 1:, :, :]], dim=-2)


def block_table(keys, block_size):
    """keys (b, g, t, d) -> (table (b*g*M, B*d), M): block rows, M rows per (sequence, head).

    A cache buffer whose per-head stride is whole blocks is viewed as it is (decoding must not copy
    the cache per step); other keys are copied once.
    """
    b, g, t, d = keys.shape
    row = block_size * d
    head_stride = keys.stride(1)
    if keys.stride(3) == 1 and keys.stride(2) == d and head_stride % row == 0 and keys.stride(0) == g * head_stride:
        rows_per_head = head_stride // row
        return keys.as_strided((b * g * rows_per_head, row), (row, 1)), rows_per_head
    m = t // block_size
    return keys[:, :, : m * block_size].reshape(b * g * m, row), m


def gather_blocks(table, rows_per_head, block_ids, head_dim):
    """table (b*g*M, B*d) from block_table, block_ids (b, g, T, n) -> (b, g, T, n*B, d): each
    query's block keys. One index_select over the flat block table: far faster on CPU than
    advanced indexing.
    """
    b, g, tile_len, _ = block_ids.shape
    row_offsets = (torch.arange(b * g, device=table.device) * rows_per_head).view(b, g, 1, 1)
    gathered = table.index_select(0, (block_ids + row_offsets).flatten())
    return gathered.view(b, g, tile_len, -1, head_dim)


def attend_tile(q, block_q, slab_k, slab_v, slab_positions, block_k, block_v, block_visible, window, chunk):
    """Attention of one tile of queries over its window slab and its retrieved blocks.

    q (b, g, T, r, d), token-major, with T = c * C, and C = W or c = 1, in the window keys' frame
    and already scaled by 1/sqrt(d); block_q like q, in the block keys' frame; slab_k/v (b, g, T+W, d)
    and slab_positions (b, T+W) start W-1 before the first query; block_k/v (b, g, T, n*B, d);
    block_visible (b, g, T, n*B) -> out (b, g, T, r, d).

    Queries go in chunks of C: each query scores the C+W keys of its chunk, not the tile's slab.
    Token-major rows (a query's r heads side by side) let window and block logits share one
    layout, so they meet in one softmax without transposes.
    """
    b, g, tile_len, r, d = q.shape
    num_chunks, span = tile_len // chunk, chunk + window
    chunk_keys = chunk_slab(slab_k, num_chunks, window)  # (b, g, c, span, d)
    chunk_values = chunk_slab(slab_v, num_chunks, window)
    chunk_positions = chunk_slab(slab_positions[..., None], num_chunks, window)[..., 0]  # (b, c, span)
    offsets = torch.arange(span, device=q.device)[None, :] - torch.arange(chunk, device=q.device)[:, None]
    band = (offsets >= 0) & (offsets < window)  # (C, span): query a sees chunk keys a .. a+W-1
    hidden = ~(band[None, None] & (chunk_positions >= 0)[:, :, None, :])  # (b, c, C, span)
    q_rows = q.reshape(b, g, num_chunks, chunk * r, d)
    window_logits = (q_rows @ chunk_keys.transpose(-1, -2)).view(b, g, num_chunks, chunk, r, span)
    window_logits.masked_fill_(hidden[:, None, :, :, None], NEG_INF)  # a fresh matmul output: in place
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    if block_k is None:
        weights = window_logits.softmax(dim=-1, dtype=softmax_dtype).to(q.dtype)
        return (weights.view(b, g, num_chunks, chunk * r, span) @ chunk_values).view(q.shape)
    block_logits = block_q @ block_k.transpose(-1, -2)  # (b, g, T, r, n*B)
    block_logits.masked_fill_(~block_visible[:, :, :, None], NEG_INF)
    logits = torch.cat([window_logits.view(b, g, tile_len, r, span), block_logits], dim=-1)
    weights = logits.softmax(dim=-1, dtype=softmax_dtype).to(q.dtype)
    window_weights, block_weights = weights.split([span, block_logits.shape[-1]], dim=-1)
    out = window_weights.reshape(b, g, num_chunks, chunk * r, span) @ chunk_values
    return out.view(q.shape) + block_weights @ block_v


def window_band(num_queries, first_query, first_key, num_keys, window, device):
    """(s, t) bool: query first_query + i sees key first_key + j in its window (distance 0 .. W-1)."""
    offset = (first_key + torch.arange(num_keys, device=device))[None, :]
    offset = offset - (first_query + torch.arange(num_queries, device=device))[:, None]
    return (offset <= 0) & (offset > -window)


def far_mask(block_ids, valid, length, window, block_size):
    """The retrieved keys each query of a sequence from position 0 sees, as a mask.

    block_ids/valid (b, g, s, n) -> (b, g, s, s) bool: keys of selected blocks older than the window.
    """
    positions = torch.arange(length, device=block_ids.device)
    older = positions[None, :] <= positions[:, None] - window
    num_blocks = -(-length // block_size)
    # Invalid slots all point at one extra column, so they never overwrite a real selection.
    selected = torch.zeros(*block_ids.shape[:3], num_blocks + 1, dtype=torch.bool, device=block_ids.device)
    selected.scatter_(3, block_ids.masked_fill(~valid, num_blocks), True)
    return selected[..., :num_blocks].repeat_interleave(block_size, dim=3)[..., :length] & older


def folded_sdpa(q, keys, values, mask):
    """q (b, h, s, d), keys/values (b, g, t, d), mask (b, g, s, t) shared by a group -> (b, h, s, d).

    The query heads of a KV group fold into the query axis, so keys are never repeated per head.
    """
    b, h, s, d = q.shape
    g, t = keys.shape[1], keys.shape[2]
    r = h // g
    folded_mask = mask[:, :, None].expand(b, g, r, s, t).reshape(b, g, r * s, t)
    out = F.scaled_dot_product_attention(q.reshape(b, g, r * s, d), keys, values, attn_mask=folded_mask)
    return out.view(b, h, s, d)


def far_positions(query_positions, window):
    """query_positions (b, s) -> (b, s): the distance W + (t mod W) at which capped retrieved keys sit."""
    return window + query_positions % window


class AnnLayerCache(KVBuffer):
    """KV buffer plus the block summaries and the retriever's state (e.g. HNSW graphs) of one layer."""

    def __init__(self, retriever, reserve, block_size, summary):
        super().__init__(reserve, granularity=block_size)
        self.retriever = retriever
        self.block_size = block_size
        self.summary = summary
        self.summaries = None

    def update_summaries(self, starts, ends):
        """Recompute the summaries of every block that the last write touched.

        summaries (b, g, m, e) covers blocks complete in every row up to ends; blocks that hold a
        row's not-yet-real positions (padding) are recomputed once real keys replace them.
        """
        first = int(starts.min()) // self.block_size
        end = int(ends.max()) // self.block_size
        fresh = block_summaries(self.k, first, end, self.block_size, self.summary)
        self.summaries = with_capacity(self.summaries, fresh, end, self.reserve // self.block_size)
        self.summaries[:, :, first:end] = fresh
        return self.summaries[:, :, :end]


class AnnAttention:
    def __init__(self, config):
        self.kv_heads = config.num_key_value_heads
        self.window = config.ann_window
        self.block_size = config.ann_block_size
        self.top_n = config.ann_top_n
        self.capped = config.ann_block_position == "capped"
        self.summary = config.ann_block_summary
        self.config = config

    def new_layer_cache(self, reserve=0):
        return AnnLayerCache(build_retriever(self.config), reserve, self.block_size, self.summary)

    def is_dense(self, last_position):
        """True when dense causal attention is exact for every query up to last_position.

        With capped positions only while every key is in the window; with true positions also
        while no query has more candidate blocks than top_n.
        """
        if self.capped:
            return last_position < self.window
        return (last_position - self.window) // self.block_size + 1 <= self.top_n

    def __call__(self, q, k, v, starts, ends, layer_cache, rope):
        """q (b, h, s, d), k/v (b, g, s, d) of the new tokens, unrotated -> out (b, h, s, d).

        starts None: a causal pass over a whole sequence from position 0 without cache (training).
        Else starts (b,) and ends (b,) give each row's first new position and its end of real
        tokens, and layer_cache is this layer's AnnLayerCache. The cache stores keys in the frame
        that blocks are scored and read in: unrotated when capped, rotated otherwise.
        """
        b, h, s, d = q.shape
        first = torch.zeros(b, dtype=torch.long, device=q.device) if starts is None else starts
        ends = first + s if ends is None else ends
        query_positions = rope.positions
        k = self.stored_frame(k, rope)
        if layer_cache is None:
            keys, values = k, v
        else:
            keys, values = layer_cache.append(k, v, first)
        last_position = int(first.max()) + s - 1
        if self.is_dense(last_position):
            if layer_cache is not None:
                layer_cache.update_summaries(first, ends)
            return dense_attention(rope(q), self.window_frame(keys, rope), values, starts)
        if layer_cache is None:
            retriever = build_retriever(self.config)
            summaries = block_summaries(k, 0, s // self.block_size, self.block_size, self.summary)
        else:
            retriever = layer_cache.retriever
            summaries = layer_cache.update_summaries(first, ends)

        if s <= MASKED_SDPA_MAX_LEN and bool((first == 0).all()):
            window_q, block_q = self.query_frames(q, rope)
            group_queries = selection_queries(block_q.detach(), self.kv_heads, self.summary)
            limits = candidate_count(torch.minimum(query_positions, ends[:, None] - 1), self.window, self.block_size)
            with torch.no_grad():
                top_n = min(self.top_n, int(limits.max()))
                block_ids, valid = retriever.select(group_queries, summaries, limits, top_n)
                far = far_mask(block_ids, valid, s, self.window, self.block_size)
            return self.masked_sdpa(window_q, keys[:, :, :s], values[:, :, :s], far, rope)
        return self.tiled(q, keys, values, first, ends, retriever, summaries, rope)

    def tiled(self, q, keys, values, first, ends, retriever, summaries, rope):
        """Queries in tiles: each tile selects its blocks, gathers their keys and attends over its
        window slab and them (attend_tile). Arguments as in __call__, with keys and values
        everything stored (b, g, t, d) and summaries those of the complete blocks.

        Whatever a tile reads of a whole-call tensor comes from one op per call (split, unbind,
        one gather), never a slice per tile: a slice's backward writes a zero gradient of the whole
        tensor, once per tile.
        """
        b, h, s, d = q.shape
        window = self.window
        tile_size = self.tile_size(s)
        tile_begins = range(0, s, tile_size)
        slab_k, slab_v, slab_positions = window_slab(keys, values, first, len(tile_begins) * tile_size, window)
        if self.capped:
            slab_k = rope.moved(slab_positions)(slab_k)
        slab_tiles = zip(*(
            tensor.unfold(-2, tile_size + window, tile_size).transpose(-1, -2).unbind(-3)
            for tensor in (slab_k, slab_v, slab_positions[..., None])
        ))
        key_table, rows_per_head = block_table(keys, self.block_size)
        value_table, _ = block_table(values, self.block_size)
        far_rope = self.far_rope(rope)  # cos/sin once per call, sliced per tile
        scale = 1.0 / math.sqrt(d)
        grouped_shape = (b, self.kv_heads, h // self.kv_heads, -1, d)

        def plan(tile_begin, q_tile, slab):
            """One tile's queries in both frames, padded to whole chunks, and its selected blocks."""
            tile_len = q_tile.shape[2]
            tile_end = tile_begin + tile_len
            far_tile = None if far_rope is None else far_rope.slice(tile_begin, tile_end)
            window_q, block_q = self.query_frames(q_tile * scale, rope.slice(tile_begin, tile_end), far_tile)
            group_queries = selection_queries(block_q.detach(), self.kv_heads, self.summary)
            chunk = min(window, tile_len)
            padded_len = -(-tile_len // chunk) * chunk
            if padded_len > tile_len:
                pad = (0, 0, 0, padded_len - tile_len)
                window_q, block_q, group_queries = F.pad(window_q, pad), F.pad(block_q, pad), F.pad(group_queries, pad)
            positions = first[:, None] + tile_begin + torch.arange(padded_len, device=q.device)
            limits = candidate_count(torch.minimum(positions, ends[:, None] - 1), window, self.block_size)
            # No query has more than limits.max() candidates: more slots would only be padding.
            top_n = min(self.top_n, int(limits.max()))
            selection = None
            if top_n:
                with torch.no_grad():
                    selection = retriever.select(group_queries, summaries, limits, top_n)
            slab = [part[..., : padded_len + window, :] for part in slab]
            return tile_len, chunk, positions, window_q, block_q, slab, selection

        tiles = []
        for tile_len, chunk, positions, window_q, block_q, slab, selection in map(
            plan, tile_begins, q.split(tile_size, dim=2), slab_tiles
        ):
            block_k = block_v = block_visible = None
            if selection is not None:
                block_ids, valid = selection
                block_k = gather_blocks(key_table, rows_per_head, block_ids, d)
                block_v = gather_blocks(value_table, rows_per_head, block_ids, d)
                key_positions = block_ids[..., None] * self.block_size + torch.arange(self.block_size, device=q.device)
                older_than_window = key_positions <= (positions - window)[:, None, :, None, None]
                block_visible = (valid[..., None] & older_than_window).flatten(-2)
            out = attend_tile(
                window_q.view(grouped_shape).transpose(2, 3),
                block_q.view(grouped_shape).transpose(2, 3),
                slab[0], slab[1], slab[2][..., 0], block_k, block_v, block_visible, window, chunk,
            )
            tiles.append(out[:, :, :tile_len].transpose(1, 2))  # (b, T, g, r, d)
        # (b, s, h, d) memory seen as (b, h, s, d): the output projection reads it without a copy
        return torch.cat(tiles, dim=1).view(b, s, h, d).transpose(1, 2)

    def tile_size(self, s):
        """Queries per tile for s new queries: QUERY_TILE rounded up to whole windows (chunks of W
        then tile it exactly), or all s queries padded to whole chunks when they are fewer."""
        size = QUERY_TILE if self.window > QUERY_TILE else -(-QUERY_TILE // self.window) * self.window
        chunk = min(self.window, s)
        return min(size, -(-s // chunk) * chunk)

    def far_rope(self, rope):
        """The Rope that puts queries in the frame of capped retrieved keys (None for true positions)."""
        if not self.capped:
            return None
        return rope.moved(far_positions(rope.positions, self.window))

    def query_frames(self, q, rope, far_rope=None):
        """Unrotated q (b, h, s, d) -> (q for window keys, q for block keys), each (b, h, s, d).

        far_rope: self.far_rope(rope) when the caller has it already.
        """
        window_q = rope(q)
        if not self.capped:
            return window_q, window_q
        return window_q, (far_rope or self.far_rope(rope))(q)

    def stored_frame(self, k, rope):
        """Unrotated k (b, g, s, d) -> the frame the cache stores: unrotated when capped, else rotated."""
        return k if self.capped else rope(k)

    def window_frame(self, keys, rope):
        """Stored keys (b, g, t, d) of positions 0 .. t-1, rotated at their positions for the window."""
        if not self.capped:
            return keys
        positions = torch.arange(keys.shape[2], device=keys.device).expand(keys.shape[0], -1)
        return rope.at(keys, positions)

    def masked_sdpa(self, q, keys, values, far, rope):
        """Whole sequences from position 0, blocks already selected (far: (b, g, s, s)): fused SDPA.

        True positions: one call, window band or far mask. Capped: one call per aligned chunk of W
        queries, over its window keys and every far key rotated to the chunk's capped position.
        """
        s = q.shape[2]
        window_keys = rope(keys) if self.capped else keys  # the new tokens: rope's own cos/sin, no recompute
        if not self.capped:
            band = window_band(s, 0, 0, s, self.window, q.device)
            return folded_sdpa(q, window_keys, values, far | band)
        outs = []
        for begin in range(0, s, self.window):
            end = min(begin + self.window, s)
            low = max(0, begin - self.window + 1)
            chunk_keys, chunk_values = window_keys[:, :, low:end], values[:, :, low:end]
            band = window_band(end - begin, begin, low, end - low, self.window, q.device)
            mask = band.expand(*far.shape[:2], *band.shape)
            if begin >= self.window:
                # far keys of the chunk's queries are older than begin; they all sit at the chunk's capped position
                capped_at = torch.full((q.shape[0], 1), begin - self.window, device=q.device)
                chunk_keys = torch.cat([rope.at(keys[:, :, :begin], capped_at), chunk_keys], dim=2)
                chunk_values = torch.cat([values[:, :, :begin], chunk_values], dim=2)
                mask = torch.cat([far[:, :, begin:end, :begin], mask], dim=3)
            outs.append(folded_sdpa(q[:, :, begin:end], chunk_keys, chunk_values, mask))
        return torch.cat(outs, dim=2)
