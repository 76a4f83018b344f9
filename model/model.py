"""MiniMind: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings).

Parameter names follow transformers' Llama so weights copy one to one (tests/test_parity.py).
The attention module and its pluggable cores live in model/attention.py.

Padding. Sequences are processed in their own coordinates (position 0 = first real token), so a
left-padded batch is rolled left before the layers and rolled back after; positions, RoPE and the
ANN blocks then never depend on how much padding a sequence had.

Generation is transformers' own `generate` (greedy, sampling, streamers, pipelines,
`prefill_chunk_size` for long prompts) over a `MiniMindCache`; `stream_generate` yields its tokens
step by step. `save_pretrained` writes the model code next to the weights, so the folder loads
with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` anywhere.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# Older transformers releases (5.0 among them) copy only the model file's direct `from .x import`
# modules out of a local trust_remote_code folder, so every module of the package is named here.
from .ann_attention import AnnAttention, query_spans  # noqa: F401
from .attention import Attention, split_old_key_shift
from .config import MiniMindConfig
from .context_parallel import ContextParallelLM  # noqa: F401
from .dense_attention import DenseAttention  # noqa: F401
from .hnsw import HnswRetriever  # noqa: F401
from .kv_cache import MiniMindCache
from .pruned_selection import pruned_select  # noqa: F401
from .retrieval import build_retriever  # noqa: F401
from .rope import Rope
from .streaming import stream_steps

# transformers 5.x renamed past_key_values to cache; generate passes and reads the name of its version.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


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
    def __init__(self, config, layer=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, starts, ends, layer_cache, spans=None):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), rope, starts, ends, layer_cache, spans))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class MiniMindModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, layer) for layer in range(config.num_hidden_layers))
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


class MiniMindForCausalLM(PreTrainedModel, GenerationMixin):
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

    def training_state(self):
        """What training keeps between steps besides weights and optimizer: each ANN layer's
        DistractorMemory, by layer index (empty without ann_distractor_memory)."""
        if self.config.attn_impl != "ann" or not self.config.ann_distractor_memory:
            return {}
        return {index: layer.self_attn.core.distractor_memory.state() for index, layer in enumerate(self.model.layers)}

    def load_training_state(self, state):
        device = self.lm_head.weight.device
        for index, entries in state.items():
            self.model.layers[index].self_attn.core.distractor_memory.load_state(entries, device)

    def new_cache(self, reserve=0):
        """An empty cache; reserve = expected final length (prompt + new tokens) avoids regrowth."""
        return MiniMindCache([layer.self_attn.core.new_layer_cache(reserve) for layer in self.model.layers])

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        cache=None,
        use_cache=False,
        logits_to_keep=0,
        inputs_embeds=None,
        past_key_values=None,
        **unused,
    ):
        """input_ids (b, s), or inputs_embeds (b, s, hidden) -> logits (b, s or logits_to_keep, vocab);
        loss when labels (b, s) are given.

        With a cache the s tokens continue each cached sequence. attention_mask (b, columns so far)
        marks real tokens; padding may only come before a row's first real token, so a left-padded
        prompt may be prefilled in one call or in chunks.
        """
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = x.shape[:2]
        cache = past_key_values if cache is None else cache
        if use_cache and cache is None:
            cache = self.new_cache()
        continuing = cache is not None and cache.lengths is not None
        left_pad, real_lengths = None, None
        if attention_mask is not None and not bool(attention_mask[:, -s:].bool().all()):
            left_pad, real_lengths = padding_offsets(attention_mask[:, -s:])
            if continuing and bool(((real_lengths < s) & (cache.lengths > 0)).any()):
                raise ValueError("attention_mask: padding after a row's first real token (only left padding works)")
            x = roll_rows(x, left_pad)

        if cache is None:
            starts = ends = None
            positions = torch.arange(s, device=x.device).expand(b, s)
        else:
            starts = cache.lengths if continuing else torch.zeros(b, dtype=torch.long, device=x.device)
            positions = starts[:, None] + torch.arange(s, device=x.device)
            ends = starts + (real_lengths if real_lengths is not None else s)

        rope = Rope(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        spans = query_spans(starts, ends, b, s, x.device)  # read once on the host, for every layer
        for index, layer in enumerate(self.model.layers):
            x = layer(x, rope, starts, ends, None if cache is None else cache.layers[index], spans)
        x = self.model.norm(x)

        if cache is not None:
            cache.lengths = ends
            cache.columns += s
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
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: cache if use_cache else None})

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate()'s cache hook: a MiniMindCache reserved for the whole output instead of a DynamicCache."""
        given = model_kwargs.get(CACHE_NAME)
        if given is not None and not isinstance(given, MiniMindCache):
            raise ValueError(f"cache must be a MiniMindCache (model.new_cache()), got {type(given).__name__}")
        if generation_config.cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                "MiniMind keeps its own cache (MiniMindCache)"
            )
        if generation_config.num_beams > 1:
            raise ValueError(f"num_beams={generation_config.num_beams}: beam search is not supported (use num_beams=1)")
        if given is not None:
            given._is_user_defined = True
        elif generation_config.use_cache:
            model_kwargs[CACHE_NAME] = self.new_cache(reserve=generation_config.max_length)

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
        """Yield the next token of every sequence, (b,) on the CPU, one step at a time.

        transformers' generate does the work: temperature 0 is greedy, a finished sequence (it
        produced eos) yields the pad id until all are finished, and the prompt is prefilled in
        chunks of prefill_chunk tokens, so very long prompts never hold more than one chunk's
        activations. Stopping reading stops generation.
        """
        check_sampling(temperature, top_p, top_k, max_new_tokens)
        if max_new_tokens == 0:
            return
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if temperature else {}
        yield from stream_steps(
            self.generate,
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.config.eos_token_id if eos_token_id is None else eos_token_id,
            prefill_chunk_size=prefill_chunk,
            do_sample=bool(temperature),
            **sampling,
        )


def check_sampling(temperature, top_p, top_k, max_new_tokens):
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be a non-negative integer, got {top_k}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens}")


# exist_ok: a folder loaded with trust_remote_code registers its own copy of these classes.
AutoConfig.register(MiniMindConfig.model_type, MiniMindConfig, exist_ok=True)
AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM, exist_ok=True)
# save_pretrained then copies the model code into the folder and names it in config.json's auto_map.
MiniMindConfig.register_for_auto_class("AutoConfig")
MiniMindForCausalLM.register_for_auto_class("AutoModelForCausalLM")
