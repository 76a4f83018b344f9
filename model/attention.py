"""The attention module: q/k/v projections, token shift, and a pluggable attention core.

`Attention` projects and shifts its input and hands unrotated q/k/v to a core that owns what
happens next, dense causal attention (model/dense_attention.py) or ANN attention
(model/ann_attention.py). Both cores speak the same interface:

    core(q, k, v, starts, ends, layer_cache, rope, spans) -> out
        q: (b, h, s, d), k/v: (b, hkv, s, d) for the s new tokens, q and k not yet rotated;
        starts: None for a plain causal pass from position 0 without cache, else a (b,) tensor with
        the position of each sequence's first new token; ends: None, or (b,) the end of each
        row's real tokens (a padded prompt is shorter than s); layer_cache: the core's per-layer cache;
        rope: the `Rope` of the new tokens' positions; spans: the `QuerySpans` of starts and ends
        (model/ann_attention.py), read on the host once per forward by the model, or None.
"""

import torch
from torch import nn

from .ann_attention import AnnAttention
from .dense_attention import DenseAttention


def build_attention_core(config, layer=None):
    return AnnAttention(config, layer) if config.attn_impl == "ann" else DenseAttention(config)


class Attention(nn.Module):
    def __init__(self, config, layer=None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # Token shift (smeared keys, Olsson et al., 2022): a key also reads its key_shift previous
        # tokens (a query its query_shift previous tokens) with learned per-channel weights, zero at
        # the start, so one layer can match "the token after X" (after "X Y" with two) and copying
        # circuits form in hundreds of steps instead of needing a previous-token head to compose with.
        # A key's first previous token (k_shift) and the ones beyond it (k_shift_wide) are separate
        # parameters so the optimizer can hold the wider ones back (trainer/optim.py).
        self.k_shift = shift_weights(min(config.key_shift, 1), config.hidden_size)
        self.k_shift_wide = shift_weights(config.key_shift - 1, config.hidden_size)
        self.q_shift = shift_weights(config.query_shift, config.hidden_size)
        self.num_shifted = max(config.key_shift, config.query_shift)
        self.core = build_attention_core(config, layer)

    def forward(self, x, rope, starts, ends, layer_cache, spans=None):
        b, s, _ = x.shape
        previous = previous_inputs(x, starts, ends, layer_cache, self.num_shifted) if self.num_shifted else None
        key_weights = [*rows(self.k_shift), *rows(self.k_shift_wide)]
        query_input, key_input = with_previous(x, rows(self.q_shift), previous), with_previous(x, key_weights, previous)
        q = self.q_proj(query_input).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key_input).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = self.core(q, k, v, starts, ends, layer_cache, rope, spans)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def train(self, mode=True):
        """Train or evaluation mode, for the core too: ANN's cross-batch distractors are training's only."""
        self.core.training = mode
        return super().train(mode)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        split_old_key_shift(state_dict, prefix + "k_shift")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def split_old_key_shift(state_dict, key):
    """Weights saved before k_shift was split hold every key row in one (key_shift, c) tensor at `key`
    (a name ending in k_shift): in place, it becomes k_shift (1, c) and k_shift_wide (key_shift - 1, c)."""
    key_rows, wide_key = state_dict.get(key), key + "_wide"
    if key_rows is not None and len(key_rows) > 1 and wide_key not in state_dict:
        state_dict[key], state_dict[wide_key] = key_rows[:1], key_rows[1:]


def shift_weights(count, hidden_size):
    """A zero (count, c) token-shift parameter, or None when count is 0."""
    return nn.Parameter(torch.zeros(count, hidden_size)) if count > 0 else None


def rows(weights):
    """The (c,) rows of an (n, c) parameter; none for None."""
    return [] if weights is None else list(weights)


def previous_inputs(x, starts, ends, layer_cache, count):
    """x (b, s, c) -> [each token's j-th previous token's input (b, s, c), j = 1 .. count]; zeros before position 0.

    With a cache, the first new tokens' previous inputs are the ones the cache kept from the last
    call, and this call's last `count` real tokens (ending at ends - starts - 1) are kept for the next.
    """
    b, s, c = x.shape
    carried = None if layer_cache is None else layer_cache.last_inputs
    history = torch.cat([x.new_zeros(b, count, c) if carried is None else carried, x], dim=1)  # (b, count + s, c)
    if layer_cache is not None:
        kept = ((ends - starts)[:, None] + torch.arange(count, device=x.device)).view(b, count, 1).expand(b, count, c)
        layer_cache.last_inputs = history.gather(1, kept)
    return [history[:, count - j : count - j + s] for j in range(1, count + 1)]


def with_previous(x, weights, previous):
    """x (b, s, c) plus weights[j] (c,) times the (j+1)-th previous input, for each weight row j."""
    if not weights:
        return x
    return x + sum(weight * earlier for weight, earlier in zip(weights, previous))
