"""MiniMind: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings).

Parameter names follow transformers' Llama so weights copy one to one (tests/test_parity.py).
The attention module and its pluggable cores live in model/attention.py.

Padding. Sequences are processed in their own coordinates (position 0 = first real token), so a
left-padded batch is rolled left before the layers and rolled back after; positions, RoPE and the
ANN blocks then never depend on how much padding a sequence had.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention import Attention, split_old_key_shift
from .config import MiniMindConfig
from .kv_cache import MiniMindCache
from .rope import Rope


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


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


def old_layout_weights(folder):
    """The weights of a model folder whose k_shift holds every key row, split the current way; else None.

    transformers loads parameters by name without Attention._load_from_state_dict, so such a
    folder's (key_shift, c) k_shift would not fit the (1, c) parameter.
    """
    path = None if folder is None else Path(folder) / "model.safetensors"
    if path is None or not path.is_file():
        return None
    with safe_open(path, framework="pt") as weights:
        names = set(weights.keys())
        old = [name for name in names if name.endswith(".k_shift") and name + "_wide" not in names
               and weights.get_slice(name).get_shape()[0] > 1]
    if not old:
        return None
    state_dict = load_file(path)
    for name in old:
        split_old_key_shift(state_dict, name)
    return state_dict


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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' loader, which also takes a folder saved before Attention split its k_shift."""
        state_dict = old_layout_weights(pretrained_model_name_or_path)
        if state_dict is None:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        kwargs["config"] = kwargs.get("config") or MiniMindConfig.from_pretrained(pretrained_model_name_or_path)
        return super().from_pretrained(None, *model_args, state_dict=state_dict, **kwargs)

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
