"""Block summaries and selection comparisons that the retrieval tests share."""

import numpy as np
import torch


def structured_summaries(num_blocks, dim=32, topics=12, seed=0):
    """Block summaries that look like a document's: a drifting mean plus recurring topics, not i.i.d."""
    generator = np.random.default_rng(seed)
    topic_vectors = generator.normal(size=(topics, dim)) * 2.0
    drift = np.cumsum(generator.normal(scale=0.05, size=(num_blocks, dim)), axis=0)
    topic_of_block = np.repeat(generator.integers(0, topics, size=num_blocks // 4 + 1), 4)[:num_blocks]
    vectors = drift + topic_vectors[topic_of_block] + generator.normal(scale=0.5, size=(num_blocks, dim))
    queries = topic_vectors[generator.integers(0, topics, size=64)] + generator.normal(scale=0.5, size=(64, dim))
    as_tensor = lambda array: torch.tensor(array, dtype=torch.float32)[None, None]  # noqa: E731
    return as_tensor(queries), as_tensor(vectors)


def selected_sets(block_ids, valid):
    return [set(ids[ok].tolist()) for ids, ok in zip(block_ids.reshape(-1, block_ids.shape[-1]), valid.reshape(-1, valid.shape[-1]))]


def recall(found, expected):
    return np.mean([len(a & b) / len(b) if b else 1.0 for a, b in zip(found, expected)])
