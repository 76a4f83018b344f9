"""Model configuration: one transformers `PretrainedConfig` with named size presets.

The attention switch `attn_impl` selects dense causal attention (the baseline) or ANN attention
(sliding window + top-n retrieved blocks, see model/ann_attention.py). Every setting is checked
here, at construction, so an impossible model fails before any data is read.
"""

import math

from transformers import PretrainedConfig

ATTN_IMPLS = ("dense", "ann")
RETRIEVERS = ("exact", "hnsw", "auto", "pruned")
BLOCK_POSITIONS = ("capped", "true")
BLOCK_SUMMARIES = ("bounds", "mean", "keys")
MAX_TOKEN_SHIFT = 4  # key_shift / query_shift: how many previous tokens a key / query may mix in

# hidden, layers, query heads, kv heads. "tiny" is what the offline CPU demo trains in minutes;
# "small" and "base" are minimind2's 26M and 104M models.
PRESETS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2),
    "base": dict(hidden_size=768, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2),
}


class MiniMindConfig(PretrainedConfig):
    model_type = "minimind"

    def __init__(
        self,
        vocab_size=6400,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=None,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        dropout=0.0,
        key_shift=0,
        query_shift=0,
        attn_impl="dense",
        ann_window=64,
        ann_block_size=16,
        ann_top_n=4,
        ann_retrieval="exact",
        ann_block_position="capped",
        ann_block_summary="bounds",
        ann_auto_threshold=16384,
        ann_retrieval_layers=None,
        ann_logn_length=None,
        ann_batch_distractors=False,
        ann_distractor_memory=0,
        ann_distractor_blocks=0,
        hnsw_m=32,
        hnsw_ef_construction=200,
        hnsw_ef_search=64,
        hnsw_keys_per_head=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        # SwiGLU keeps the parameter count of a 4x MLP with 8/3 x width, rounded up to 64 like minimind.
        self.intermediate_size = intermediate_size or 64 * math.ceil(hidden_size * 8 / 3 / 64)
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.dropout = dropout
        # Configs saved when key_shift was a switch hold true/false: one previous token or none.
        self.key_shift = int(key_shift) if isinstance(key_shift, bool) else key_shift
        self.query_shift = int(query_shift) if isinstance(query_shift, bool) else query_shift
        self.attn_impl = attn_impl
        self.ann_window = ann_window
        self.ann_block_size = ann_block_size
        self.ann_top_n = ann_top_n
        self.ann_retrieval = ann_retrieval
        self.ann_block_position = ann_block_position
        self.ann_block_summary = ann_block_summary
        self.ann_auto_threshold = ann_auto_threshold
        # None: every layer retrieves; else the indices of the layers that do. The others attend to
        # their window only (top_n 0), as DuoAttention's streaming heads, and keep no HNSW graphs.
        self.ann_retrieval_layers = (
            list(ann_retrieval_layers) if isinstance(ann_retrieval_layers, (list, tuple)) else ann_retrieval_layers
        )
        # None: off; else a query at position t >= ann_logn_length in a layer that retrieves is scaled
        # by ln(t + 1) / ln(ann_logn_length), as Qwen's log-n attention: sharper attention where
        # the retrieved blocks are the best of more candidates than training showed.
        self.ann_logn_length = ann_logn_length
        # Training only: a retrieving layer's queries also select among the complete blocks of the
        # batch's other rows, as though each row followed their text (Focused Transformer's
        # cross-batch training), so the copy learns to win against far more candidates than its own
        # sequence holds (model/ann_attention.py, AnnAttention.with_batch_distractors).
        self.ann_batch_distractors = ann_batch_distractors
        # Training only, with ann_batch_distractors: the complete blocks of this many earlier batches
        # stay (detached) as further candidates, so a query meets thousands of distractor blocks as
        # in a long prompt, not only the batch's few hundred (AnnAttention.with_batch_distractors).
        self.ann_distractor_memory = ann_distractor_memory
        # Training only, with ann_batch_distractors: 0 lets a query's top_n compete among its own
        # and the foreign blocks alike. N > 0 keeps its top_n among its own candidates and adds the
        # N best foreign blocks on top, so the block it must copy from is never displaced while
        # the blocks beside it are the best of many, as at 1M tokens.
        self.ann_distractor_blocks = ann_distractor_blocks
        self.hnsw_m = hnsw_m
        self.hnsw_ef_construction = hnsw_ef_construction
        self.hnsw_ef_search = hnsw_ef_search
        self.hnsw_keys_per_head = hnsw_keys_per_head
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_settings()

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def layer_top_n(self, layer):
        """Blocks each query of decoder layer `layer` retrieves: ann_top_n, or 0 in a layer that
        ann_retrieval_layers leaves out. layer None: a core outside a model, which retrieves."""
        if layer is None or self.ann_retrieval_layers is None or layer in self.ann_retrieval_layers:
            return self.ann_top_n
        return 0

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        settings = dict(PRESETS[name])
        settings.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**settings)

    def validate_settings(self):
        problems = []

        def positive_int(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
                return False
            return True

        sizes_ok = all(
            [
                positive_int(name)
                for name in (
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "intermediate_size",
                    "max_position_embeddings",
                )
            ]
        )
        if sizes_ok:
            if self.hidden_size % self.num_attention_heads:
                problems.append(
                    f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})"
                )
            elif self.head_dim % 2:
                problems.append(f"head_dim (hidden_size / num_attention_heads = {self.head_dim}) must be even for RoPE")
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append(
                    f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                    f"num_attention_heads ({self.num_attention_heads})"
                )
        if self.attn_impl not in ATTN_IMPLS:
            problems.append(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.ann_retrieval not in RETRIEVERS:
            problems.append(f"ann_retrieval must be one of {RETRIEVERS}, got {self.ann_retrieval!r}")
        if self.ann_block_position not in BLOCK_POSITIONS:
            problems.append(f"ann_block_position must be one of {BLOCK_POSITIONS}, got {self.ann_block_position!r}")
        if self.ann_block_summary not in BLOCK_SUMMARIES:
            problems.append(f"ann_block_summary must be one of {BLOCK_SUMMARIES}, got {self.ann_block_summary!r}")
        if self.ann_block_summary == "keys" and self.ann_retrieval == "pruned":
            problems.append(
                "ann_block_summary 'keys' cannot be pruned by super-block bounds (a block's keys are its "
                "summary): set ann_retrieval to 'exact', 'hnsw' or 'auto'"
            )
        ann_ok = all(
            [
                positive_int(name)
                for name in (
                    "ann_window", "ann_block_size", "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search",
                    "hnsw_keys_per_head",
                )
            ]
        )
        if ann_ok and self.ann_window % self.ann_block_size:
            problems.append(
                f"ann_window ({self.ann_window}) must be a multiple of ann_block_size ({self.ann_block_size})"
            )
        for name in ("ann_top_n", "ann_auto_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        layers = self.ann_retrieval_layers
        if layers is not None and (
            not isinstance(layers, list)
            or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers)
            or len(set(layers)) != len(layers)
            or (isinstance(self.num_hidden_layers, int) and not all(0 <= layer < self.num_hidden_layers for layer in layers))
        ):
            problems.append(
                f"ann_retrieval_layers must be None or distinct layer indices in 0..num_hidden_layers-1 "
                f"({self.num_hidden_layers} layers), got {layers!r}"
            )
        logn = self.ann_logn_length
        if logn is not None and (not isinstance(logn, int) or isinstance(logn, bool) or logn < 2):
            problems.append(f"ann_logn_length must be None or an integer >= 2 (a trained length), got {logn!r}")
        if not isinstance(self.ann_batch_distractors, bool):
            problems.append(f"ann_batch_distractors must be true or false, got {self.ann_batch_distractors!r}")
        elif self.ann_batch_distractors and self.ann_block_position != "capped":
            problems.append(
                "ann_batch_distractors needs ann_block_position 'capped': another row's blocks have no true "
                "distance to a query"
            )
        for name, counted, what in (
            ("ann_distractor_memory", "earlier batches kept", "the kept blocks"),
            ("ann_distractor_blocks", "foreign blocks added", "the added blocks"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{name} must be an integer >= 0 ({counted}), got {value!r}")
            elif value and self.ann_batch_distractors is not True:
                problems.append(f"{name} needs ann_batch_distractors: {what} are distractors")
        for name in ("key_shift", "query_shift"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_SHIFT:
                problems.append(
                    f"{name} must be an integer in 0..{MAX_TOKEN_SHIFT} (previous tokens mixed in), got {value!r}"
                )
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if problems:
            raise ValueError("invalid MiniMindConfig: " + "; ".join(problems))
