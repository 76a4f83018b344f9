"""MiniMind with ANN attention. Importing this package registers the model with transformers' Auto classes."""

from .config import PRESETS, MiniMindConfig
from .model import MiniMindCache, MiniMindForCausalLM

__all__ = ["PRESETS", "MiniMindCache", "MiniMindConfig", "MiniMindForCausalLM"]
