"""Dense causal softmax attention: the baseline core every comparison is made against."""

import torch
import torch.nn.functional as F

from .kv_cache import KVBuffer


def dense_attention(q, keys, values, starts):
    """Causal attention of q (b, h, s, d) at positions starts + i over keys/values (b, hkv, t, d).

    starts None means the s queries and keys are one sequence from position 0 (is_causal SDPA).
    Decoding (s == 1) folds the query heads of each KV group into the query axis instead of
    repeating the whole cache per head, which would cost O(t) copies per token; longer chunks
    repeat the keys once and share one (b, 1, s, t) mask across heads.
    """
    b, h, s, d = q.shape
    kv_heads = keys.shape[1]
    groups = h // kv_heads
    if s == 1 and starts is not None:
        mask = None
        if not bool((starts == keys.shape[2] - 1).all()):
            mask = (torch.arange(keys.shape[2], device=q.device)[None, :] <= starts[:, None])[:, None, None]
        folded = q.reshape(b, kv_heads, groups, d)
        return F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask).view(b, h, 1, d)
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    if starts is None or (bool((starts == 0).all()) and keys.shape[2] == s):
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    query_positions = starts[:, None] + torch.arange(s, device=q.device)
    visible = torch.arange(keys.shape[2], device=q.device)[None, None, :] <= query_positions[:, :, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])


class DenseAttention:
    """Causal softmax attention over every earlier key: the baseline every comparison is made against."""

    def __init__(self, config):
        pass

    def new_layer_cache(self, reserve=0):
        return KVBuffer(reserve)

    def __call__(self, q, k, v, starts, ends, layer_cache, rope, spans=None):
        q, k = rope(q), rope(k)
        if layer_cache is not None:
            k, v = layer_cache.append(k, v, starts, None if spans is None else spans.host_first)
        return dense_attention(q, k, v, starts)
