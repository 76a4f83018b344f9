"""FlexAttention baselines for the attention benchmarks: dense causal, and ANN attention's keys as a
block-sparse mask.

Legend (as in model/ann_attention.py): b batch, h query heads, g kv heads, r = h / g, s positions,
d head dim, n top_n, B ANN block size, W window; P the kernel's tile (128 queries by 128 keys),
p = ceil(s / P) tiles per side.

    causal  flex_attention under a causal BlockMask: the strongest dense baseline next to SDPA.
    ann     the keys ANN attention reads with true positions (ann_block_position "true": no key is
            re-rotated per query, which a mask cannot express), chosen by model.retrieval's exact
            selection on the same summaries, handed to flex_attention as a mask. Its BlockMask lists,
            per (query head, query tile), the key tiles that hold a window key or a selected block
            of any of the tile's queries; the kernel skips the others and masks inside the listed
            ones. Equal to AnnAttention with true positions and exact retrieval (tests/test_flex_cores.py).

Both take whole sequences from position 0 (fwd and fwd_bwd rows); there is no cache, so no decode.
torch has no FlexAttention backward on CPU: fwd_bwd rows need CUDA. `compiled=False` runs
flex_attention eagerly (every score materialised: small inputs only, tests).
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from model.retrieval import block_summaries, candidate_count, exact_select, selection_queries

TILE = 128
_COMPILED = {}


def flex_kernel(compiled):
    """flex_attention, compiled once per process (compilation takes tens of seconds on CPU)."""
    if not compiled:
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def causal_block_mask(length, device):
    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, length, length, device=device)


def touched_tiles(block_ids, valid, length, window, block_size):
    """block_ids/valid (b, g, s, n) -> (b, g, p, p) bool: key tile j holds a window key or a selected
    block's key of some query of query tile i (a superset of the tiles the mask lets through)."""
    b, g, s, _ = block_ids.shape
    tiles = -(-length // TILE)
    touched = torch.zeros(b, g, tiles, tiles + 1, dtype=torch.bool, device=block_ids.device)
    query_tile = (torch.arange(s, device=block_ids.device) // TILE)[None, None, :, None].expand_as(block_ids)
    # A block of B <= P keys lies in one key tile when P is a multiple of B (checked by the caller).
    key_tile = (block_ids * block_size // TILE).masked_fill(~valid, tiles)
    touched.view(b, g, -1).scatter_(2, (query_tile * (tiles + 1) + key_tile).flatten(2), True)
    first = torch.arange(tiles, device=block_ids.device) * TILE
    lowest_window_tile = (first - window + 1).clamp(min=0) // TILE
    tile_index = torch.arange(tiles, device=block_ids.device)
    in_window = (tile_index[None, :] >= lowest_window_tile[:, None]) & (tile_index[None, :] <= tile_index[:, None])
    return touched[..., :tiles] | in_window


def ann_block_mask(block_ids, valid, heads, length, window, block_size):
    """ANN attention's keys (true positions) as a BlockMask over `heads` query heads.

    block_ids/valid (b, g, s, n) from exact_select -> BlockMask whose mask_mod lets query t see key k
    when t - W < k <= t (window) or k <= t - W lies in one of t's valid selected blocks.
    """
    b, g, s, n = block_ids.shape
    group = heads // g
    touched = touched_tiles(block_ids, valid, length, window, block_size).repeat_interleave(group, dim=1)
    counts = touched.sum(-1, dtype=torch.int32)
    indices = touched.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    def mask_mod(batch, head, query_idx, key_idx):
        kv_head = head // group
        in_window = (query_idx >= key_idx) & (query_idx - key_idx < window)
        key_block = key_idx // block_size
        selected = (block_ids[batch, kv_head, query_idx, 0] == key_block) & valid[batch, kv_head, query_idx, 0]
        for slot in range(1, n):
            selected = selected | (
                (block_ids[batch, kv_head, query_idx, slot] == key_block) & valid[batch, kv_head, query_idx, slot]
            )
        return in_window | (selected & (key_idx <= query_idx - window))

    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(length, length))


class FlexCore:
    """A benchmark core (called like model/attention.py's cores) on flex_attention.

    pattern "causal" or "ann"; config: a MiniMindConfig (window, block size, top_n, summary kind).
    """

    def __init__(self, config, pattern, compiled=True):
        if pattern not in ("causal", "ann"):
            raise ValueError(f"unknown FlexAttention pattern {pattern!r}; choose causal or ann")
        if TILE % config.ann_block_size:
            raise ValueError(f"ann_block_size {config.ann_block_size} must divide the kernel tile {TILE}")
        self.pattern = pattern
        self.config = config
        self.kernel = flex_kernel(compiled)
        self.tile_fraction = None  # ann: the last call's listed key tiles / those a causal mask lists

    def select(self, q, k):
        """Rotated q (b, h, s, d), k (b, g, s, d) -> block ids, valid (b, g, s, n): exact top-n."""
        config = self.config
        b, g, s, _ = k.shape
        blocks = s // config.ann_block_size
        summaries = block_summaries(k, 0, blocks, config.ann_block_size, config.ann_block_summary)
        group_queries = selection_queries(q, g, config.ann_block_summary)
        positions = torch.arange(s, device=q.device).expand(b, s)
        limits = candidate_count(positions, config.ann_window, config.ann_block_size)
        return exact_select(group_queries, summaries, limits, config.ann_top_n)

    def __call__(self, q, k, v, starts, ends, layer_cache, rope):
        """q (b, h, s, d), k/v (b, g, s, d) unrotated, a whole sequence from position 0 -> (b, h, s, d)."""
        if starts is not None or layer_cache is not None:
            raise ValueError("FlexAttention baselines take whole sequences from position 0 (no cache)")
        q, k = rope(q), rope(k)
        length = q.shape[2]
        if self.pattern == "causal":
            block_mask = causal_block_mask(length, q.device)
        else:
            with torch.no_grad():
                block_ids, valid = self.select(q.detach(), k.detach())
            config = self.config
            block_mask = ann_block_mask(block_ids, valid, q.shape[1], length, config.ann_window, config.ann_block_size)
            tiles = block_mask.kv_num_blocks.shape[-1]
            causal_tiles = block_mask.kv_num_blocks[..., 0].numel() * tiles * (tiles + 1) / 2
            self.tile_fraction = block_mask.kv_num_blocks.sum().item() / causal_tiles
        return self.kernel(q, k, v, block_mask=block_mask, enable_gqa=True)
