"""Key/value storage for generation: a growable per-layer buffer and the whole model's cache."""

import torch
from transformers.cache_utils import Cache


def with_capacity(buffer, like, needed, minimum=0, granularity=1):
    """buffer (b, x, capacity, d), or None, with room for `needed` rows on dim 2 (doubling).

    A new buffer shaped like `like` keeps the old contents; capacity is a multiple of granularity.
    """
    if buffer is not None and buffer.shape[2] >= needed:
        return buffer
    capacity = max(needed, minimum, 0 if buffer is None else 2 * buffer.shape[2])
    capacity = -(-capacity // granularity) * granularity
    grown = like.new_zeros(*like.shape[:2], capacity, like.shape[3])
    if buffer is not None:
        grown[:, :, : buffer.shape[2]] = buffer
    return grown


class KVBuffer:
    """Keys and values of one layer for a batch, stored per sequence from position 0.

    k, v: (b, hkv, capacity, d); capacity grows by doubling so appends are amortised O(1), starts
    at `reserve` when the final length is known (no copies at all then), and is a multiple of
    `granularity` so block-structured readers can view it without copying.
    """

    def __init__(self, reserve=0, granularity=1):
        self.k = None
        self.v = None
        self.last_inputs = None  # (b, n, hidden): each row's last n real tokens' attention inputs, for token shift
        self.reserve = reserve
        self.granularity = granularity

    def write(self, k_new, v_new, starts, host_starts=None):
        """Store k_new/v_new (b, hkv, s, d) at positions starts[i] .. starts[i] + s - 1 of sequence i.

        host_starts: starts as a tuple of ints when the caller has them (nothing is read back then).
        """
        b, hkv, s, d = k_new.shape
        host_starts = tuple(starts.tolist()) if host_starts is None else host_starts
        end = max(host_starts) + s
        self.k = with_capacity(self.k, k_new, end, max(self.reserve, 256), self.granularity)
        self.v = with_capacity(self.v, v_new, end, max(self.reserve, 256), self.granularity)
        if len(set(host_starts)) == 1:
            start = host_starts[0]
            self.k[:, :, start : start + s] = k_new
            self.v[:, :, start : start + s] = v_new
        else:
            index = (starts[:, None] + torch.arange(s, device=starts.device))[:, None, :, None].expand(b, hkv, s, d)
            self.k.scatter_(2, index, k_new)
            self.v.scatter_(2, index, v_new)
        return end

    def append(self, k_new, v_new, starts, host_starts=None):
        """Write the new keys/values and return views of everything stored, (b, hkv, t, d) each."""
        end = self.write(k_new, v_new, starts, host_starts)
        return self.k[:, :, :end], self.v[:, :, :end]


class MiniMindCache(Cache):
    """Everything generation keeps between calls: one cache per layer and each sequence's length.

    A transformers `Cache`, so `GenerationMixin.generate` carries it from step to step. Rows are
    stored in their own coordinates (position 0 = first real token): `lengths` (b,) counts each
    row's real tokens, while `get_seq_length` counts input columns, padding included, because
    generate slices the next input by it. The layer caches are the attention cores' own
    (KVBuffer, AnnLayerCache with its block summaries and HNSW graphs); they cannot be cropped or
    reordered, so beam search and assisted decoding are not available.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, layer_caches):
        super().__init__(layers=layer_caches)
        self.lengths = None
        self.columns = 0

    def get_seq_length(self, layer_idx=0):
        return self.columns

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("MiniMindCache cannot reorder its rows: beam search is not supported (num_beams=1)")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("MiniMindCache cannot drop tokens: assisted decoding is not supported")
