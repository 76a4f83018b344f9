"""ANN attention: each query attends to a sliding window of recent keys plus the top-n most
relevant earlier blocks of keys.

Legend of dimension letters:
    b batch            h query heads        g kv heads         r = h / g, query heads per kv head
    s new queries      t keys (positions)   d head dim         m blocks
    e summary size (2d for bounds, d for mean; "keys" scores a block's B keys: (B, d))
    T queries per tile n top_n              B block size       W window (a multiple of B)
    C queries per chunk (C = W, or one chunk per tile)      c chunks per tile     L keys in a slab

Definition (one semantics for training, prefill and decoding). Block j holds positions
[j*B, (j+1)*B), aligned to each sequence's position 0. For a query at position t:
    window keys:      positions max(0, t-W+1) .. t;
    candidate blocks: j with j*B <= t-W (complete, past, holding a key older than the window);
    selection:        the top_n candidates by score_j, chosen per token and per kv head
                      (model/retrieval.py). With ann_block_summary "bounds" (the default, Quest's),
                      score_j = sum over the GQA group's heads and channels c of
                      max(q_c * max_c, q_c * min_c), the max/min over block j's keys: an upper
                      bound of the head's largest q . k in the block. With "keys" it is that
                      sum of the heads' largest q . k itself (every candidate key scored); with
                      "mean", (sum of the group's queries) . (mean key of block j);
    attended keys:    the window plus the selected blocks' positions <= t-W, under one softmax per
                      query head. No key counts twice, and missing candidates are just missing.
    log-n scaling:    with ann_logn_length L, a retrieving layer's query at t >= L is multiplied by
                      ln(t+1)/ln(L) before all of this (logn_scale): its attention is sharper
                      where its blocks are the best of more candidates than training showed.
                      Selection scores are linear in the query, so the blocks chosen do not change.
    distractors:      with ann_batch_distractors, a training pass reads row i as the sequence [the
                      complete blocks of the batch's other rows, row i] (with_batch_distractors);
                      with ann_distractor_memory M, [the complete blocks of the last M batches
                      (detached), those of the other rows, row i] (DistractorMemory); with
                      ann_distractor_blocks N, a query's top_n come from row i alone and the N
                      best foreign blocks are attended besides (OwnAndForeignRetriever).
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

The tiled path (AnnAttention.tiled), per tile: its queries in both frames (TileQueries), the blocks
they select, gathered (RetrievedBlocks), and attend_tile over those and the tile's WindowSlab. What
decides the loop (tile sizes, top_n bounds) is computed on the host from positions read once per
call (QuerySpans), so tiles never wait on the device.
"""

import math
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .dense_attention import dense_attention
from .kv_cache import KVBuffer, with_capacity
from .retrieval import OwnAndForeignRetriever, block_summaries, build_retriever, candidate_count, selection_queries
from .rope import apply_rope_rolled, rolled_sin, rope_cos_sin

NEG_INF = float("-inf")
QUERY_TILE = 256
# Up to this many queries from position 0, the selection becomes a boolean mask for SDPA's fused
# kernel: no per-query key copies, but O(s^2) work. Beyond it the tiles win (forward + backward,
# 1 thread, 8/2 heads, d 64: masked 37 ms vs tiled 78 ms at 512, 203 vs 208 at 1024, 846 vs 304
# at 2048; docs/BENCHMARKS.md).
MASKED_SDPA_MAX_LEN = 1024


class QuerySpans(NamedTuple):
    """Where each row's new queries lie, on the device and, read once per call, on the host.

    first (b,) long: each row's first new position; ends (b,): each row's end of real tokens;
    host_first, host_ends: the same as tuples of b ints, so that tiles read nothing back.
    """

    first: torch.Tensor
    ends: torch.Tensor
    host_first: tuple
    host_ends: tuple

    def positions(self, offset, length):
        """(b, length): the positions of new queries offset .. offset+length-1 of each row."""
        return self.first[:, None] + offset + torch.arange(length, device=self.first.device)


def query_spans(starts, ends, batch, length, device):
    """starts (b,) or None (a pass from position 0), ends (b,) or None (starts + length) -> QuerySpans.

    One host read when starts or ends is given, none for a pass from position 0. The model makes
    it once per forward and hands it to every layer.
    """
    first = torch.zeros(batch, dtype=torch.long, device=device) if starts is None else starts
    if starts is None and ends is None:
        return QuerySpans(first, first + length, (0,) * batch, (length,) * batch)
    ends = first + length if ends is None else ends
    host_first, host_ends = torch.stack([first, ends.to(first.dtype)]).tolist()
    return QuerySpans(first, ends, tuple(host_first), tuple(host_ends))


def logn_scale(positions, length):
    """positions (b, s) -> (b, s) float: max(1, ln(t + 1) / ln(length)), the log-n attention factor
    of a query at position t (1 up to position length - 1)."""
    return (positions + 1).double().log().div(math.log(length)).clamp(min=1.0)


def candidate_limits(positions, ends, window, block_size):
    """positions (b, T) of queries, ends (b,) -> (b, T): candidate blocks per query (candidate_count),
    counted at min(position, end - 1), so a padding query has no more than its row's last real one."""
    return candidate_count(torch.minimum(positions, ends[:, None] - 1), window, block_size)


def candidates_at(spans, offset, window, block_size):
    """Host ints, one per row: candidate_limits of the query `offset` past the row's first."""
    return [
        max(0, (min(first + offset, end - 1) - window) // block_size + 1)
        for first, end in zip(spans.host_first, spans.host_ends)
    ]


def most_candidates(spans, offset, window, block_size):
    """Host int: the largest candidate_limits of the queries up to `offset` past each row's first.

    candidate_count grows with the position, so it is the count at the latest such position.
    """
    return max(candidates_at(spans, offset, window, block_size))


def candidate_bounds(spans, first_offset, last_offset, window, block_size):
    """Host (fewest, most) candidate_limits of the queries first_offset .. last_offset past each
    row's first: the limits grow with the position, so the ends of the span hold both."""
    return (
        min(candidates_at(spans, first_offset, window, block_size)),
        most_candidates(spans, last_offset, window, block_size),
    )


def decodes_one_position(spans, length):
    """True when every row adds one real token (length 1) at one and the same position (host ints)."""
    position = spans.host_first[0]
    return length == 1 and all(first == position for first in spans.host_first) and all(
        end == position + 1 for end in spans.host_ends
    )


class TileQueries(NamedTuple):
    """One tile's queries, padded to whole chunks: T = c * C, with C = W or c = 1.

    window_q, block_q (b, g, T, r, d): token-major, scaled by 1/sqrt(d), in the window keys' and the
    block keys' frames; selecting (b, g, T, e): the group vectors that score blocks, detached;
    positions (b, T); chunk: C; candidates: host (fewest, most) candidate blocks of its queries.
    """

    window_q: torch.Tensor
    block_q: torch.Tensor
    selecting: torch.Tensor
    positions: torch.Tensor
    chunk: int
    candidates: tuple


class WindowSlab(NamedTuple):
    """The keys a run of queries can see in their windows, from W-1 before the first query.

    keys (b, g, L, d) in the window frame, values (b, g, L, d), positions (b, L); L = T+W for a tile.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    def head(self, length):
        """The slab's first `length` keys: a last tile holding fewer queries than the others."""
        if length == self.positions.shape[-1]:
            return self
        return WindowSlab(self.keys[..., :length, :], self.values[..., :length, :], self.positions[..., :length])


class RetrievedBlocks(NamedTuple):
    """Each query's selected blocks: keys (b, g, T, n*B, d) in the block frame, values (b, g, T, n*B, d),
    visible (b, g, T, n*B): the slot is a real selection and the key is older than the query's window."""

    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor


def window_slab(keys, values, spans, num_queries, window):
    """The keys that any of num_queries consecutive queries from each row's first can see in its window.

    keys/values (b, g, t, d), spans: QuerySpans -> WindowSlab of L = s+W keys, from W-1 before the
    first query to one past the last (that key is never visible; it makes the slab split into
    chunks). Positions outside [0, t) are clamped here and masked by attend_tile.
    """
    b, g, t, d = keys.shape
    length = num_queries + window
    positions = spans.positions(-(window - 1), length)
    begin = spans.host_first[0] - (window - 1)
    if len(set(spans.host_first)) == 1 and begin >= 0 and begin + length <= t:
        return WindowSlab(keys[:, :, begin : begin + length], values[:, :, begin : begin + length], positions)
    index = positions.clamp(0, t - 1)[:, None, :, None].expand(b, g, -1, d)
    return WindowSlab(keys.gather(2, index), values.gather(2, index), positions)


def tile_slabs(slab, tile_size, window):
    """WindowSlab of L = c*T + W keys -> c WindowSlabs of T+W keys, tile i's from key i*T.

    One unfold and one unbind per tensor: each tile's backward writes only its own piece.
    """
    keys, values, positions = (
        tensor.unfold(-2, tile_size + window, tile_size).transpose(-1, -2).unbind(-3)
        for tensor in (slab.keys, slab.values, slab.positions[..., None])
    )
    return [WindowSlab(*parts[:2], parts[2][..., 0]) for parts in zip(keys, values, positions)]


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


class BlockTables(NamedTuple):
    """The stored keys (block frame) and values as block rows: keys, values (b*g*M, B*d) (block_table);
    row_offsets (b, g, 1, 1): each (sequence, head)'s first row; key_offsets (B,): 0 .. B-1."""

    keys: torch.Tensor
    values: torch.Tensor
    block_size: int
    row_offsets: torch.Tensor
    key_offsets: torch.Tensor

    def rows(self, block_ids):
        """block_ids (b, g, T, n) -> (b*g*T*n,) the table rows holding them."""
        return (block_ids + self.row_offsets).flatten()

    def visible(self, block_ids, valid, newest):
        """block_ids/valid (b, g, T, n) -> (b, g, T, n, B) bool: key i of block j is visible when the
        slot is a real selection and j*B + i <= newest, the last position its query reads from blocks
        (position - W): (b, 1, T, 1) or one host int for all."""
        visible = torch.le(self.key_offsets, (newest - block_ids * self.block_size).unsqueeze(-1))
        return visible.logical_and_(valid.unsqueeze(-1))

    def gather(self, block_ids, valid, positions, window):
        """block_ids/valid (b, g, T, n) selected for queries at positions (b, T) -> RetrievedBlocks.

        One index_select per table over the flat block rows: far faster on CPU than advanced indexing.
        """
        b, g, tile_len, _ = block_ids.shape
        head_dim = self.keys.shape[1] // self.block_size
        rows = self.rows(block_ids)
        return RetrievedBlocks(
            self.keys.index_select(0, rows).view(b, g, tile_len, -1, head_dim),
            self.values.index_select(0, rows).view(b, g, tile_len, -1, head_dim),
            self.visible(block_ids, valid, (positions - window)[:, None, :, None]).flatten(-2),
        )


def block_tables(keys, values, block_size):
    """keys/values (b, g, t, d) -> BlockTables: views of a cache buffer, else one copy each."""
    key_table, rows_per_head = block_table(keys, block_size)
    value_table, _ = block_table(values, block_size)
    b, g = keys.shape[:2]
    row_offsets = (torch.arange(b * g, device=keys.device) * rows_per_head).view(b, g, 1, 1)
    return BlockTables(key_table, value_table, block_size, row_offsets, torch.arange(block_size, device=keys.device))


def attend_tile(tile, slab, blocks, window):
    """Attention of one tile of queries over its window slab and its retrieved blocks.

    tile: TileQueries (b, g, T, r, d); slab: WindowSlab of T+W keys; blocks: RetrievedBlocks, or
    None when no query has a block -> out (b, g, T, r, d), token-major.

    Queries go in chunks of C: each query scores the C+W keys of its chunk, not the tile's slab.
    Token-major rows (a query's r heads side by side) let window and block logits share one
    layout, so they meet in one softmax without transposes.
    """
    q, chunk = tile.window_q, tile.chunk
    b, g, tile_len, r, d = q.shape
    num_chunks, span = tile_len // chunk, chunk + window
    chunk_keys = chunk_slab(slab.keys, num_chunks, window)  # (b, g, c, span, d)
    chunk_values = chunk_slab(slab.values, num_chunks, window)
    chunk_positions = chunk_slab(slab.positions[..., None], num_chunks, window)[..., 0]  # (b, c, span)
    offsets = torch.arange(span, device=q.device)[None, :] - torch.arange(chunk, device=q.device)[:, None]
    band = (offsets >= 0) & (offsets < window)  # (C, span): query a sees chunk keys a .. a+W-1
    hidden = ~(band[None, None] & (chunk_positions >= 0)[:, :, None, :])  # (b, c, C, span)
    q_rows = q.reshape(b, g, num_chunks, chunk * r, d)
    window_logits = (q_rows @ chunk_keys.transpose(-1, -2)).view(b, g, num_chunks, chunk, r, span)
    window_logits.masked_fill_(hidden[:, None, :, :, None], NEG_INF)  # a fresh matmul output: in place
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    if blocks is None:
        weights = window_logits.softmax(dim=-1, dtype=softmax_dtype).to(q.dtype)
        return (weights.view(b, g, num_chunks, chunk * r, span) @ chunk_values).view(q.shape)
    block_logits = tile.block_q @ blocks.keys.transpose(-1, -2)  # (b, g, T, r, n*B)
    block_logits.masked_fill_(~blocks.visible[:, :, :, None], NEG_INF)
    logits = torch.cat([window_logits.view(b, g, tile_len, r, span), block_logits], dim=-1)
    weights = logits.softmax(dim=-1, dtype=softmax_dtype).to(q.dtype)
    window_weights, block_weights = weights.split([span, block_logits.shape[-1]], dim=-1)
    out = window_weights.reshape(b, g, num_chunks, chunk * r, span) @ chunk_values
    return out.view(q.shape) + block_weights @ blocks.values


def attend_one(q, keys, values, mask):
    """One query per row over its attended keys, window and far ones alike, under one softmax.

    q (b, h, 1, d) scaled, in the keys' frame; keys/values (b, g, K, d); mask (b, g, 1, K) additive
    (0 visible, -inf not) -> (b, h, 1, d). The query heads of a KV group fold into SDPA's query
    axis, so keys are never repeated per head; an additive mask spares SDPA converting a bool one.
    """
    b, h, _, d = q.shape
    g = keys.shape[1]
    out = F.scaled_dot_product_attention(q.view(b, g, h // g, d), keys, values, attn_mask=mask, scale=1.0)
    return out.view(b, h, 1, d)


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
    return out.reshape(b, h, s, d)  # CUDA kernels may return another memory layout than (b, g, r*s, d)


def other_rows_blocks(x, block_size):
    """x (b, g, s, d) -> (b, g, (b-1)*m*B, d): for each row, the m = s // B complete blocks of every
    other row, in row order (gradients flow back to them)."""
    b, g, s, d = x.shape
    length = s // block_size * block_size
    others = torch.tensor([[j for j in range(b) if j != i] for i in range(b)], device=x.device)
    return x[:, :, :length][others].permute(0, 2, 1, 3, 4).reshape(b, g, (b - 1) * length, d)


class DistractorMemory:
    """One layer's keys and values of the complete blocks of its last `batches` training batches,
    detached: candidates that a training query selects and attends to as it does the other rows'
    blocks, but that take no gradient (their weights have moved on since, as in MoCo's queue).

    Held as a list of (keys, values), each (g, b*m*B, d), oldest first; state() / load_state() carry
    it through a checkpoint so that a resumed run continues exactly.
    """

    def __init__(self, batches):
        self.batches = batches
        self.entries = []

    def blocks(self, rows):
        """-> [keys], [values]: each kept batch's blocks (rows, g, P_i, d), oldest first, the same for
        every row (expanded, not copied), to be concatenated once with the rest of the prefix."""
        keys = [keys.unsqueeze(0).expand(rows, -1, -1, -1) for keys, _ in self.entries]
        values = [values.unsqueeze(0).expand(rows, -1, -1, -1) for _, values in self.entries]
        return keys, values

    def remember(self, k, v, block_size):
        """Keep the complete blocks of k, v (b, g, s, d), dropping the oldest batch beyond `batches`."""
        if not self.batches:
            return
        b, g, s, d = k.shape
        length = s // block_size * block_size
        flat = [x[:, :, :length].detach().transpose(0, 1).reshape(g, b * length, d) for x in (k, v)]
        self.entries = (self.entries + [tuple(flat)])[-self.batches :]

    def state(self):
        return [(keys.cpu(), values.cpu()) for keys, values in self.entries]

    def load_state(self, entries, device):
        self.entries = [(keys.to(device), values.to(device)) for keys, values in entries][-self.batches :]


def far_positions(query_positions, window):
    """query_positions (b, s) -> (b, s): the distance W + (t mod W) at which capped retrieved keys sit."""
    return window + query_positions % window


class WindowRing(NamedTuple):
    """A decoding query's window, kept from step to step so that a step rotates one key, not W.

    The positions end-W .. end-1 of every row, position p in slot p mod W: keys (b, g, W, d) in the
    frame of capped retrieved keys for the queries of aligned chunk `chunk` (positions chunk*W ..
    chunk*W + W-1; see FrameRotation), values (b, g, W, d). They are the window slots
    of the layer cache's AttendedKeys.
    """

    keys: torch.Tensor
    values: torch.Tensor
    end: int
    chunk: int


class FrameRotation(NamedTuple):
    """RoPE in the frame of capped retrieved keys, where a query at t sits at W + t mod W
    (far_positions) and its window keys within 1 .. 2W-1 (fresh_ring).

    cos, signed_sin (1, 1, 2W, d): apply_rope_rolled's tables of the distances 0 .. 2W-1.
    key_matrices, query_matrices (W, d, d): the rotation to distance W + i as a matrix, x @ M[i],
    for one token (the newest key, the query): one matmul instead of apply_rope_rolled's kernels.
    The query's carry the softmax scale 1/sqrt(d) as well.
    """

    cos: torch.Tensor
    signed_sin: torch.Tensor
    key_matrices: torch.Tensor
    query_matrices: torch.Tensor


@lru_cache(maxsize=8)
def frame_rotation(window, head_dim, theta, dtype, device):
    """The FrameRotation of these settings, one shared by every layer (W * d * d matrices each)."""
    cos, sin = rope_cos_sin(torch.arange(2 * window, device=device)[None], head_dim, theta, dtype)
    signed_sin = rolled_sin(sin)
    identity = torch.eye(head_dim, dtype=dtype, device=device)
    key_matrices = apply_rope_rolled(identity, cos[0, 0, window:, None], signed_sin[0, 0, window:, None])
    return FrameRotation(cos, signed_sin, key_matrices, key_matrices / math.sqrt(head_dim))


class AttendedKeys(NamedTuple):
    """What a decoding query attends to, in buffers kept from step to step so that a step writes
    its keys in place instead of concatenating them.

    keys, values (b, g, W + n*B, d): the window (slot p mod W, the WindowRing when capped), then
    the far keys (the selected blocks, or positions 0 .. t-W while top_n covers every candidate);
    mask (b, g, 1, W + n*B): 0 where a key is visible, -inf where not (a far slot past the query's
    candidates, or beyond t-W). visible, hidden: 0-d tensors of 0 and -inf to write it with. The
    parts are sliced afresh each step (window, far): a view kept across steps would stay behind the
    buffer when a step writes tensors that require grad.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    visible: torch.Tensor
    hidden: torch.Tensor

    def window(self, window):
        """(keys, values) of the window slots, (b, g, W, d) each."""
        return self.keys.narrow(2, 0, window), self.values.narrow(2, 0, window)

    def far(self, window):
        """(keys, values) of the far slots (b, g, n*B, d) and their mask (b, g, 1, n*B)."""
        slots = self.keys.shape[2] - window
        return self.keys.narrow(2, window, slots), self.values.narrow(2, window, slots), self.mask.narrow(3, window, slots)


def attended_keys(like, window, far_slots):
    """Empty AttendedKeys for keys like (b, g, t, d): every window slot visible, every far one not."""
    b, g, _, d = like.shape
    keys, values = (like.new_zeros(b, g, window + far_slots, d) for _ in range(2))
    mask = like.new_zeros(b, g, 1, window + far_slots)
    mask[..., window:] = NEG_INF
    return AttendedKeys(keys, values, mask, like.new_zeros(()), like.new_full((), NEG_INF))


def fresh_ring(keys, values, position, frame, attended):
    """keys (unrotated)/values (b, g, t, d) stored up to `position` >= W-1, frame: FrameRotation
    -> WindowRing of the window of the query at `position`, written into attended's window slots.

    In that query's block frame the key at p sits at p - (chunk - 1) * W: offset+1 .. offset+W.
    """
    window = frame.cos.shape[2] // 2
    chunk, offset = divmod(position, window)
    low, distances = position - window + 1, slice(offset + 1, offset + 1 + window)
    rotated = apply_rope_rolled(
        keys[:, :, low : position + 1], frame.cos[:, :, distances], frame.signed_sin[:, :, distances]
    )
    shift = low % window  # position low goes to slot low mod W
    ring_keys, ring_values = attended.window(window)
    ring_keys.copy_(rotated.roll(shift, 2))
    ring_values.copy_(values[:, :, low : position + 1].roll(shift, 2))
    return WindowRing(ring_keys, ring_values, position + 1, chunk)


def advanced_ring(ring, keys, values, position, frame, attended):
    """WindowRing (or None) -> the WindowRing of the query at `position` (fresh_ring's arguments).

    A ring that holds the window up to position-1 in the same chunk's frame takes the new key into
    the slot of the one that left the window (in place); any other is made afresh.
    """
    window = frame.cos.shape[2] // 2
    chunk, offset = divmod(position, window)
    if ring is None or ring.end != position or ring.chunk != chunk:
        return fresh_ring(keys, values, position, frame, attended)
    ring.keys[:, :, offset : offset + 1] = keys[:, :, position : position + 1] @ frame.key_matrices[offset]
    ring.values[:, :, offset : offset + 1] = values[:, :, position : position + 1]
    return ring._replace(end=position + 1)


class AnnLayerCache(KVBuffer):
    """KV buffer plus the block summaries and the retriever's state (e.g. HNSW graphs) of one layer."""

    def __init__(self, retriever, reserve, block_size, summary):
        super().__init__(reserve, granularity=block_size)
        self.retriever = retriever
        self.block_size = block_size
        self.summary = summary
        self.summaries = None
        self.ring = None  # WindowRing of the last decode step (capped positions), see decode_step
        self.attended = None  # AttendedKeys of the decode steps
        self.tables = None  # (the key buffer, its BlockTables), see decode_tables

    def write(self, k_new, v_new, starts, host_starts=None):
        """KVBuffer.write; a write other than one token per row at the ring's end drops the ring
        (it may have overwritten keys the ring holds)."""
        host_starts = tuple(starts.tolist()) if host_starts is None else host_starts
        if self.ring is not None and not (k_new.shape[2] == 1 and set(host_starts) == {self.ring.end}):
            self.ring = None
        return super().write(k_new, v_new, starts, host_starts)

    def attended_keys(self, window, far_slots):
        """The AttendedKeys of a decode step, made afresh (dropping the ring that lives in them)
        when the batch, heads, dtype or number of slots differ from the last step's."""
        shape = (*self.k.shape[:2], window + far_slots, self.k.shape[3])
        if self.attended is None or self.attended.keys.shape != shape or self.attended.keys.dtype != self.k.dtype:
            self.attended = attended_keys(self.k, window, far_slots)
            self.ring = None
        return self.attended

    def decode_tables(self):
        """BlockTables of the whole buffers: views, made again only when the buffers grow."""
        if self.tables is None or self.tables[0] is not self.k:
            self.tables = (self.k, block_tables(self.k, self.v, self.block_size))
        return self.tables[1]

    def update_summaries(self, first_position, end_position):
        """Recompute the summaries of every block that the last write touched.

        first_position: the earliest row's first new position; end_position: the latest row's end
        of real tokens (host ints). summaries (b, g, m, e) covers blocks complete in every row up to
        end_position; blocks that hold a row's not-yet-real positions (padding) are recomputed once
        real keys replace them.
        """
        first = first_position // self.block_size
        end = end_position // self.block_size
        if self.summary == "keys":  # the stored keys themselves: nothing to copy or keep
            self.retriever.summaries_changed(first)
            return block_summaries(self.k, 0, end, self.block_size, self.summary)
        if first == end and self.summaries is not None and self.summaries.shape[2] >= end:  # most decoding steps
            return self.summaries[:, :, :end]
        fresh = block_summaries(self.k, first, end, self.block_size, self.summary)
        self.summaries = with_capacity(self.summaries, fresh, end, self.reserve // self.block_size)
        self.summaries[:, :, first:end] = fresh
        self.retriever.summaries_changed(first)
        return self.summaries[:, :, :end]


class AnnAttention:
    def __init__(self, config, layer=None):
        """The core of decoder layer `layer` (None: a core on its own, which retrieves ann_top_n)."""
        self.kv_heads = config.num_key_value_heads
        self.window = config.ann_window
        self.block_size = config.ann_block_size
        self.top_n = config.layer_top_n(layer)
        self.logn_length = config.ann_logn_length if self.top_n else None
        self.capped = config.ann_block_position == "capped"
        self.summary = config.ann_block_summary
        self.batch_distractors = config.ann_batch_distractors
        self.distractor_memory = DistractorMemory(config.ann_distractor_memory)
        self.distractor_blocks = config.ann_distractor_blocks
        self.training = True  # as a new module's; the owning Attention's train() sets it
        self.config = config

    def new_retriever(self):
        """The config's retriever; a layer that retrieves nothing keeps no retrieval state (graphs):
        exact selection of 0 blocks."""
        return build_retriever(self.config, None if self.top_n else "exact")

    def new_layer_cache(self, reserve=0):
        return AnnLayerCache(self.new_retriever(), reserve, self.block_size, self.summary)

    def is_dense(self, last_position):
        """True when dense causal attention is exact for every query up to last_position.

        With capped positions only while every key is in the window; with true positions also
        while no query has more candidate blocks than top_n.
        """
        if self.capped:
            return last_position < self.window
        return (last_position - self.window) // self.block_size + 1 <= self.top_n

    def __call__(self, q, k, v, starts, ends, layer_cache, rope, spans=None):
        """q (b, h, s, d), k/v (b, g, s, d) of the new tokens, unrotated -> out (b, h, s, d).

        starts None: a causal pass over a whole sequence from position 0 without cache (training).
        Else starts (b,) and ends (b,) give each row's first new position and its end of real
        tokens, and layer_cache is this layer's AnnLayerCache. The cache stores keys in the frame
        that blocks are scored and read in: unrotated when capped, rotated otherwise.
        """
        b, h, s, d = q.shape
        if self.distracts(q, starts, layer_cache):
            return self.with_batch_distractors(q, k, v, rope)
        spans = query_spans(starts, ends, b, s, q.device) if spans is None else spans
        q = self.logn_queries(q, rope.positions, max(spans.host_first) + s - 1)
        k = self.stored_frame(k, rope)
        if layer_cache is None:
            keys, values = k, v
        else:
            keys, values = layer_cache.append(k, v, spans.first, spans.host_first)
        if self.is_dense(max(spans.host_first) + s - 1):
            if layer_cache is not None:
                layer_cache.update_summaries(min(spans.host_first), max(spans.host_ends))
            return dense_attention(rope(q), self.window_frame(keys, rope), values, starts)
        if layer_cache is None:
            retriever = self.new_retriever()
            summaries = block_summaries(k, 0, s // self.block_size, self.block_size, self.summary)
        else:
            retriever = layer_cache.retriever
            summaries = layer_cache.update_summaries(min(spans.host_first), max(spans.host_ends))

        if s <= MASKED_SDPA_MAX_LEN and not any(spans.host_first):
            window_q, block_q = self.query_frames(q, rope)
            group_queries = selection_queries(block_q.detach(), self.kv_heads, self.summary)
            limits = candidate_limits(spans.positions(0, s), spans.ends, self.window, self.block_size)
            bounds = candidate_bounds(spans, 0, s - 1, self.window, self.block_size)
            top_n = min(self.top_n, bounds[1])
            with torch.no_grad():
                block_ids, valid = retriever.select(group_queries, summaries, limits, top_n, bounds)
                far = far_mask(block_ids, valid, s, self.window, self.block_size)
            return self.masked_sdpa(window_q, keys[:, :, :s], values[:, :, :s], far, rope)
        if layer_cache is not None and decodes_one_position(spans, s):
            return self.decode_step(q, keys, values, spans, layer_cache, summaries, rope)
        return self.tiled(q, keys, values, spans, retriever, summaries, rope)

    def distracts(self, q, starts, layer_cache):
        """True for a training pass (training mode, no cache, from position 0) of a retrieving layer
        with ann_batch_distractors, over a batch of rows long enough to hold a block."""
        b, _, s, _ = q.shape
        return (
            self.batch_distractors and self.training and bool(self.top_n) and starts is None
            and layer_cache is None and b > 1 and s >= self.block_size
        )

    def with_batch_distractors(self, q, k, v, rope):
        """A training pass in which each row follows the complete blocks of the batch's other rows:
        its queries select among those (b-1)*m blocks as well as their own candidates, attend to
        what they select, and send gradients to the other rows' keys and values. Training at s tokens
        then shows a query the best of about b*s/B candidates instead of s/B, nearer what a long
        prompt shows (Focused Transformer's cross-batch training, Tworkowski et al., 2023).

        Capped keys have no distance from the query, so a foreign block reads as an own far block
        does. The first W-1 queries of a row also see the others' last keys in their windows, as the
        first tokens of a document in a long prompt see the text before it. With ann_distractor_memory
        the blocks of earlier batches come first (DistractorMemory), and this batch's are kept.
        q (b, h, s, d), k/v (b, g, s, d) unrotated -> out (b, h, s, d).
        """
        b, _, s, _ = q.shape
        kept_keys, kept_values = self.distractor_memory.blocks(b)
        keys = torch.cat([*kept_keys, other_rows_blocks(k, self.block_size), k], dim=2)
        values = torch.cat([*kept_values, other_rows_blocks(v, self.block_size), v], dim=2)
        self.distractor_memory.remember(k, v, self.block_size)
        offset = keys.shape[2] - s
        rope = rope.moved(rope.positions + offset)
        q = self.logn_queries(q, rope.positions, offset + s - 1)
        first = torch.full((b,), offset, dtype=torch.long, device=q.device)
        spans = QuerySpans(first, first + s, (offset,) * b, (offset + s,) * b)
        summaries = block_summaries(keys, 0, keys.shape[2] // self.block_size, self.block_size, self.summary)
        retriever = self.new_retriever()
        if self.distractor_blocks:
            retriever = OwnAndForeignRetriever(
                retriever, self.new_retriever(), offset // self.block_size, self.distractor_blocks
            )
        return self.tiled(q, keys, values, spans, retriever, summaries, rope)

    def decode_step(self, q, keys, values, spans, layer_cache, summaries, rope):
        """One new query per row, every row at the same position t >= W (decodes_one_position, not
        is_dense): what the tiled path computes for it, without tiles, slabs or chunk padding, and
        without selection when top_n covers every candidate block (then the far keys are exactly
        positions 0 .. t-W, whatever order a selection would list them in).

        Everything is scored in the block frame, window keys included: capped, the window keys are
        the layer cache's WindowRing, rotated into it, so a step rotates its own key only. Window and
        far keys are written into the layer cache's AttendedKeys and meet in one SDPA call.

        q (b, h, 1, d) unrotated, keys/values (b, g, t+1, d) everything stored, summaries (b, g, m, e)
        -> out (b, h, 1, d).
        """
        position = spans.host_first[0]
        attended = layer_cache.attended_keys(self.window, self.top_n * self.block_size)
        q = self.decode_window(q, keys, values, position, layer_cache, rope, attended)
        self.decode_far(q, keys, values, position, layer_cache, summaries, attended)
        return attend_one(q, attended.keys, attended.values, attended.mask)

    def decode_window(self, q, keys, values, position, layer_cache, rope, attended):
        """Unrotated q (b, h, 1, d) at `position` -> q scaled by 1/sqrt(d), in the block frame; its W
        window keys and their values in that frame go into attended's window slots. Capped, they
        are the layer cache's WindowRing, advanced by this step's key; else the stored (rotated) keys."""
        window = self.window
        if not self.capped:
            low = position - window + 1
            window_keys, window_values = attended.window(window)
            window_keys.copy_(keys[:, :, low : position + 1])
            window_values.copy_(values[:, :, low : position + 1])
            return rope(q * (1.0 / math.sqrt(q.shape[-1])))
        frame = frame_rotation(window, rope.head_dim, rope.theta, rope.dtype, q.device)
        layer_cache.ring = advanced_ring(layer_cache.ring, keys, values, position, frame, attended)
        return q @ frame.query_matrices[position % window]

    def decode_far(self, q, keys, values, position, layer_cache, summaries, attended):
        """q (b, h, 1, d) in the block frame -> attended's far slots and their mask: positions
        0 .. t-W when top_n covers every candidate block, else the top_n blocks that
        layer_cache.retriever selects, a key visible when its slot is a real selection and it is
        older than the window."""
        if not self.top_n:
            return
        window, block_size = self.window, self.block_size
        last_far = position - window
        candidates = last_far // block_size + 1
        far_keys, far_values, mask = attended.far(window)
        if candidates <= self.top_n:
            count = last_far + 1
            far_keys[:, :, :count] = keys[:, :, :count]
            far_values[:, :, :count] = values[:, :, :count]
            mask[..., :count] = 0.0
            mask[..., count:] = NEG_INF
            return
        limits = torch.full((q.shape[0], 1), candidates, dtype=torch.long, device=q.device)
        with torch.no_grad():
            selecting = selection_queries(q.detach(), self.kv_heads, self.summary)
            block_ids, valid = layer_cache.retriever.select(
                selecting, summaries, limits, self.top_n, (candidates, candidates)
            )
        tables = layer_cache.decode_tables()
        rows = tables.rows(block_ids)
        far_keys.copy_(tables.keys.index_select(0, rows).view(far_keys.shape))
        far_values.copy_(tables.values.index_select(0, rows).view(far_values.shape))
        visible = tables.visible(block_ids, valid, last_far)
        torch.where(visible, attended.visible, attended.hidden, out=mask.unflatten(-1, visible.shape[-2:]))

    def tiled(self, q, keys, values, spans, retriever, summaries, rope):
        """Queries in tiles: each tile selects its blocks, gathers their keys and attends over its
        window slab and them. q (b, h, s, d) unrotated, keys/values (b, g, t, d) everything stored,
        spans: QuerySpans, summaries (b, g, m, e) of the complete blocks -> out (b, h, s, d), whose
        memory is (b, s, h, d): the output projection reads it without a copy.

        Whatever a tile reads of a whole-call tensor comes from one op per call (split, unbind,
        one gather), never a slice per tile: a slice's backward writes a zero gradient of the whole
        tensor, once per tile. Cos/sin are computed once per call and sliced per tile.
        """
        b, h, s, d = q.shape
        tile_size = self.tile_size(s)
        q_tiles = q.split(tile_size, dim=2)
        slab = window_slab(keys, values, spans, len(q_tiles) * tile_size, self.window)
        if self.capped:
            slab = slab._replace(keys=rope.moved(slab.positions)(slab.keys))
        tables = block_tables(keys, values, self.block_size)
        far_rope = self.far_rope(rope)
        outputs = []
        for index, (q_tile, tile_slab) in enumerate(zip(q_tiles, tile_slabs(slab, tile_size, self.window))):
            tile = self.tile_queries(q_tile, index * tile_size, spans, rope, far_rope)
            tile_slab = tile_slab.head(tile.positions.shape[1] + self.window)
            # Bound to no name, the gathered blocks (a tile's largest tensors) are freed before the
            # next tile gathers its own, unless autograd keeps them.
            out = attend_tile(
                tile, tile_slab, self.select_blocks(tile, spans, retriever, summaries, tables), self.window
            )
            outputs.append(out[:, :, : q_tile.shape[2]].transpose(1, 2))  # (b, T, g, r, d)
        return torch.cat(outputs, dim=1).view(b, s, h, d).transpose(1, 2)

    def tile_queries(self, q_tile, tile_begin, spans, rope, far_rope):
        """Unrotated q_tile (b, h, T, d) of new queries tile_begin .. tile_begin+T-1 -> TileQueries,
        padded to whole chunks. rope and far_rope (self.far_rope(rope)) are the call's: their
        cos/sin are sliced, not recomputed.
        """
        b, h, tile_len, d = q_tile.shape
        tile_end = tile_begin + tile_len
        far_tile = None if far_rope is None else far_rope.slice(tile_begin, tile_end)
        window_q, block_q = self.query_frames(q_tile * (1.0 / math.sqrt(d)), rope.slice(tile_begin, tile_end), far_tile)
        chunk = min(self.window, tile_len)
        padded_len = -(-tile_len // chunk) * chunk
        if padded_len > tile_len:
            pad = (0, 0, 0, padded_len - tile_len)
            window_q, block_q = F.pad(window_q, pad), F.pad(block_q, pad)
        token_major = (b, self.kv_heads, h // self.kv_heads, padded_len, d)
        return TileQueries(
            window_q.view(token_major).transpose(2, 3),
            block_q.view(token_major).transpose(2, 3),
            selection_queries(block_q.detach(), self.kv_heads, self.summary),
            spans.positions(tile_begin, padded_len),
            chunk,
            candidate_bounds(spans, tile_begin, tile_begin + padded_len - 1, self.window, self.block_size),
        )

    def select_blocks(self, tile, spans, retriever, summaries, tables):
        """The tile's top-n candidate blocks per query and kv head, gathered from tables
        (BlockTables): RetrievedBlocks, or None when top_n or every query's candidates are 0.
        """
        # No query has more candidates than the most: more slots would only be padding.
        top_n = min(self.top_n, tile.candidates[1])
        if not top_n:
            return None
        limits = candidate_limits(tile.positions, spans.ends, self.window, self.block_size)
        with torch.no_grad():
            block_ids, valid = retriever.select(tile.selecting, summaries, limits, top_n, tile.candidates)
        return tables.gather(block_ids, valid, tile.positions, self.window)

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

    def logn_queries(self, q, positions, last_position):
        """q (b, h, s, d) at positions (b, s), the largest of them last_position (a host int) -> q scaled
        by logn_scale in a layer that retrieves with ann_logn_length, else q itself."""
        if self.logn_length is None or last_position < self.logn_length:
            return q
        return q * logn_scale(positions, self.logn_length).to(q.dtype)[:, None, :, None]

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
