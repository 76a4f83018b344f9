"""MiniMind with ANN attention. Importing this package registers the model with transformers' Auto classes."""

from .config import PRESETS, MiniMindConfig
from .kv_cache import MiniMindCache
from .model import MiniMindForCausalLM

__all__ = ["PRESETS", "MiniMindCache", "MiniMindConfig", "MiniMindForCausalLM"]
