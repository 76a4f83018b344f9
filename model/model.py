"""MiniMind: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings).

Parameter names follow transformers' Llama so weights copy one to one (tests/test_parity.py).
Attention is pluggable: `Attention` projects and rotates q/k/v, and hands them to an attention
core that owns what happens next, dense causal attention (`DenseAttention`, below) or ANN
attention (`model/ann_attention.py`). Both cores speak the same interface:

    core(q, k, v, starts, ends, layer_cache, rope) -> out
        q: (b, h, s, d), k/v: (b, hkv, s, d) for the s new tokens, q and k not yet rotated;
        starts: None for a plain causal pass from position 0 without cache, else a (b,) tensor with
        the position of each sequence's first new token; ends: None, or (b,) the end of each
        row's real tokens (a padded prompt is shorter than s); layer_cache: the core's per-layer cache;
        rope: the `Rope` of the new tokens' positions.

Padding. Sequences are processed in their own coordinates (position 0 = first real token), so a
left-padded batch is rolled left before the layers and rolled back after; positions, RoPE and the
ANN blocks then never depend on how much padding a sequence had.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import MiniMindConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """positions (b, s) -> cos, sin (b, 1, s, d), Llama's layout (frequencies repeated twice).

    Angles are computed in float32 as Llama does, or in float64 for a float64 model.
    """
    angle_dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=angle_dtype) / head_dim))
    freqs = positions.to(angle_dtype)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class Rope:
    """The rotary embedding of one forward call: rotates the new tokens, or any positions on demand.

    Attention cores get q and k unrotated, so a core may store keys in another frame (ANN attention
    keeps retrieved keys at capped distances, model/ann_attention.py).
    """

    def __init__(self, positions, head_dim, theta, dtype, cos_sin=None):
        self.positions, self.head_dim, self.theta, self.dtype = positions, head_dim, theta, dtype
        self.cos, self.sin = cos_sin or rope_cos_sin(positions, head_dim, theta, dtype)

    def slice(self, begin, end):
        """The Rope of new tokens begin .. end-1 of this one's, sharing its cos/sin."""
        cos_sin = (self.cos[:, :, begin:end], self.sin[:, :, begin:end])
        return Rope(self.positions[:, begin:end], self.head_dim, self.theta, self.dtype, cos_sin)

    def moved(self, positions):
        """The Rope of other positions (b, s) with this one's frequencies."""
        return Rope(positions, self.head_dim, self.theta, self.dtype)

    def __call__(self, x):
        """x (b, heads, s, d) of the new tokens, rotated at their positions."""
        return apply_rope(x, self.cos, self.sin)

    def at(self, x, positions):
        """x (b, ..., s, d) rotated at positions (b, s)."""
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, self.dtype)
        shape = (cos.shape[0],) + (1,) * (x.dim() - 3) + cos.shape[-2:]
        return apply_rope(x, cos.view(shape), sin.view(shape))


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

    def write(self, k_new, v_new, starts):
        """Store k_new/v_new (b, hkv, s, d) at positions starts[i] .. starts[i] + s - 1 of sequence i."""
        b, hkv, s, d = k_new.shape
        end = int(starts.max()) + s
        self.k = with_capacity(self.k, k_new, end, max(self.reserve, 256), self.granularity)
        self.v = with_capacity(self.v, v_new, end, max(self.reserve, 256), self.granularity)
        if bool((starts == starts[0]).all()):
            start = int(starts[0])
            self.k[:, :, start : start + s] = k_new
            self.v[:, :, start : start + s] = v_new
        else:
            index = (starts[:, None] + torch.arange(s, device=starts.device))[:, None, :, None].expand(b, hkv, s, d)
            self.k.scatter_(2, index, k_new)
            self.v.scatter_(2, index, v_new)
        return end

    def append(self, k_new, v_new, starts):
        """Write the new keys/values and return views of everything stored, (b, hkv, t, d) each."""
        end = self.write(k_new, v_new, starts)
        return self.k[:, :, :end], self.v[:, :, :end]


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

    def __call__(self, q, k, v, starts, ends, layer_cache, rope):
        q, k = rope(q), rope(k)
        if layer_cache is not None:
            k, v = layer_cache.append(k, v, starts)
        return dense_attention(q, k, v, starts)


def build_attention_core(config):
    if config.attn_impl == "ann":
        from .ann_attention import AnnAttention

        return AnnAttention(config)
    return DenseAttention(config)


class Attention(nn.Module):
    def __init__(self, config):
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
        self.k_shift = nn.Parameter(torch.zeros(config.key_shift, config.hidden_size)) if config.key_shift else None
        self.q_shift = nn.Parameter(torch.zeros(config.query_shift, config.hidden_size)) if config.query_shift else None
        self.num_shifted = max(config.key_shift, config.query_shift)
        self.core = build_attention_core(config)

    def forward(self, x, rope, starts, ends, layer_cache):
        b, s, _ = x.shape
        previous = previous_inputs(x, starts, ends, layer_cache, self.num_shifted) if self.num_shifted else None
        query_input, key_input = with_previous(x, self.q_shift, previous), with_previous(x, self.k_shift, previous)
        q = self.q_proj(query_input).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key_input).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = self.core(q, k, v, starts, ends, layer_cache, rope)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


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
    """x (b, s, c) plus weights[j] (c,) times the (j+1)-th previous input, for each row j of weights (n, c)."""
    if weights is None:
        return x
    return x + sum(weight * earlier for weight, earlier in zip(weights, previous))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, starts, ends, layer_cache):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), rope, starts, ends, layer_cache))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class MiniMindModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiniMindCache:
    """Everything generation keeps between calls: one cache per layer and each sequence's length."""

    def __init__(self, layer_caches):
        self.layers = layer_caches
        self.lengths = None

    def get_seq_length(self):
        return 0 if self.lengths is None else int(self.lengths.max())


def padding_offsets(attention_mask):
    """attention_mask (b, s) of contiguous ones -> (left padding (b,), real lengths (b,)).

    Left or right padding is accepted; a mask with holes cannot be rolled into one run of tokens.
    """
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    left = torch.where(lengths > 0, mask.float().argmax(dim=1), torch.zeros_like(lengths))
    columns = torch.arange(mask.shape[1], device=mask.device)[None, :]
    expected = (columns >= left[:, None]) & (columns < (left + lengths)[:, None])
    if not bool((expected == mask).all()):
        raise ValueError("attention_mask must mark one contiguous run of tokens per row (left or right padding)")
    return left, lengths


def roll_rows(x, shifts):
    """Roll each row i of x (b, s, ...) left by shifts[i]: out[i, j] = x[i, (j + shifts[i]) % s]."""
    s = x.shape[1]
    index = (torch.arange(s, device=x.device)[None, :] + shifts[:, None]) % s
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, index)


class MiniMindForCausalLM(PreTrainedModel):
    config_class = MiniMindConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def new_cache(self, reserve=0):
        """An empty cache; reserve = expected final length (prompt + new tokens) avoids regrowth."""
        return MiniMindCache([layer.self_attn.core.new_layer_cache(reserve) for layer in self.model.layers])

    def forward(
        self,
        input_ids,
        attention_mask=None,
        labels=None,
        cache=None,
        use_cache=False,
        logits_to_keep=0,
        **unused,
    ):
        """input_ids (b, s) -> logits (b, s or logits_to_keep, vocab); loss when labels (b, s) are given.

        With a cache the s tokens continue each cached sequence; padding is allowed only in
        the call that starts a cache (the prompt), where attention_mask marks the real tokens.
        """
        b, s = input_ids.shape
        if use_cache and cache is None:
            cache = self.new_cache()
        continuing = cache is not None and cache.lengths is not None
        left_pad, real_lengths = None, None
        if attention_mask is not None and not bool(attention_mask[:, -s:].bool().all()):
            if continuing:
                raise ValueError("padding is only supported in the first call of a cache (the prompt)")
            left_pad, real_lengths = padding_offsets(attention_mask[:, -s:])
            input_ids = roll_rows(input_ids, left_pad)

        if cache is None:
            starts = ends = None
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        else:
            starts = cache.lengths if continuing else torch.zeros(b, dtype=torch.long, device=input_ids.device)
            positions = starts[:, None] + torch.arange(s, device=input_ids.device)
            ends = starts + (real_lengths if real_lengths is not None else s)

        x = self.model.embed_tokens(input_ids)
        rope = Rope(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, rope, starts, ends, None if cache is None else cache.layers[index])
        x = self.model.norm(x)

        if cache is not None:
            cache.lengths = ends
        if left_pad is not None:
            x = roll_rows(x, -left_pad)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)

        loss = None
        if labels is not None:
            # Shift the labels, not the logits: slicing the (b, s, vocab) logits would copy them,
            # and its backward would write a zero gradient of their size.
            next_tokens = F.pad(labels[:, 1:], (0, 1), value=-100)
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), next_tokens.reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    @torch.inference_mode()
    def stream_generate(
        self,
        input_ids,
        attention_mask=None,
        max_new_tokens=64,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        eos_token_id=None,
        prefill_chunk=None,
    ):
        """Yield the next token of every sequence, (b,), one step at a time.

        temperature 0 is greedy. A finished sequence (it produced eos) keeps yielding the pad id.
        The prompt is prefilled through the cache in chunks of prefill_chunk tokens, so very long
        prompts never hold more than one chunk's activations.
        """
        check_sampling(temperature, top_p, top_k, max_new_tokens)
        eos_token_id = self.config.eos_token_id if eos_token_id is None else eos_token_id
        s = input_ids.shape[1]
        cache = self.new_cache(reserve=s + max_new_tokens)
        chunk = prefill_chunk or s
        if attention_mask is not None and not bool(attention_mask.bool().all()) and chunk < s:
            raise ValueError("a padded batch is prefilled in one chunk; pass prefill_chunk=None")
        for begin in range(0, s, chunk):
            out = self(
                input_ids[:, begin : begin + chunk],
                attention_mask=attention_mask,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            token = sample_next(out.logits[:, -1].float(), temperature, top_p, top_k)
            token = torch.where(finished, torch.full_like(token, self.config.pad_token_id), token)
            yield token
            finished |= token == eos_token_id
            if bool(finished.all()):
                return
            out = self(token[:, None], cache=cache, use_cache=True, logits_to_keep=1)

    def generate(self, input_ids, attention_mask=None, max_new_tokens=64, streamer=None, **sampling):
        """input_ids (b, s) -> (b, s + new) with the new tokens appended; streamer(token (b,)) sees each step."""
        tokens = []
        for token in self.stream_generate(input_ids, attention_mask, max_new_tokens, **sampling):
            tokens.append(token)
            if streamer is not None:
                streamer(token)
        if not tokens:
            return input_ids
        return torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)


def check_sampling(temperature, top_p, top_k, max_new_tokens):
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be a non-negative integer, got {top_k}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens}")


def sample_next(logits, temperature, top_p, top_k):
    """logits (b, vocab) -> token ids (b,): greedy at temperature 0, else top-k / top-p sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens ranked above it already hold top_p of the mass.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1)[:, 0]


AutoConfig.register(MiniMindConfig.model_type, MiniMindConfig)
AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM)
