"""Conversation caches kept between requests: an LRU of (token ids, model cache), bounded in bytes.

A MiniMindCache (KV buffers, ANN block summaries, HNSW graphs) cannot be cropped, so an entry is
reusable only by a prompt that starts with all of its token ids; such a request takes the entry
out (nobody else may extend the same cache), prefills only the tokens after it and puts its own
cache back when done. The size of an entry is the bytes its cache holds: tensor and array storage
(spare capacity included) and an estimate for each FAISS graph.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass

import faiss
import numpy as np
import torch

# Per FAISS HNSW vector beyond its stored floats: neighbour ids (about 2M at level 0, M per level
# above, on 1/(M-1) of the vectors on average), level and offset bookkeeping.
HNSW_LINK_BYTES = 4


def faiss_index_bytes(index):
    """Estimated bytes of a FAISS HNSW index: its vectors plus its neighbour lists."""
    m = index.hnsw.nb_neighbors(1) if hasattr(index, "hnsw") else 0
    links = 2 * m + m / max(m - 1, 1)
    return int(index.ntotal * (4 * index.d + HNSW_LINK_BYTES * links + 16))


def cache_leaves(cache):
    """Every tensor, numpy array and FAISS object a model cache reaches, each once (not inside FAISS objects)."""
    seen, pending = set(), [cache]
    while pending:
        item = pending.pop()
        if id(item) in seen or item is None or isinstance(item, (int, float, str, bool)):
            continue
        seen.add(id(item))
        if isinstance(item, (torch.Tensor, np.ndarray)) or type(item).__module__.startswith("faiss"):
            yield item
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif hasattr(item, "__dict__"):
            pending.extend(vars(item).values())


def cache_bytes(cache):
    """Bytes held by a model cache: its tensors' and arrays' storage and its FAISS indexes' estimates."""
    total = 0
    for leaf in cache_leaves(cache):
        if isinstance(leaf, torch.Tensor):
            total += leaf.untyped_storage().nbytes()
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
        elif hasattr(leaf, "ntotal"):
            total += faiss_index_bytes(leaf)
    return total


def fork_cache(cache):
    """An independent copy of a model cache: FAISS indexes cloned (they cannot be pickled), the rest deep-copied.

    A FAISS member struct kept beside its index (the HNSW retriever keeps `index.hnsw`) maps to the
    clone's; SWIG hands out a new Python object per access, so they are matched by address.
    """
    leaves = list(cache_leaves(cache))
    memo, members = {}, {}
    for leaf in leaves:
        if hasattr(leaf, "ntotal"):
            clone = memo[id(leaf)] = faiss.clone_index(leaf)
            if hasattr(leaf, "hnsw"):
                members[int(leaf.hnsw.this)] = clone.hnsw
    for leaf in leaves:
        if type(leaf).__module__.startswith("faiss") and id(leaf) not in memo:
            memo[id(leaf)] = members[int(leaf.this)]
    return copy.deepcopy(cache, memo)


@dataclass
class Entry:
    """A cache holding exactly `token_ids` (prompt and generated tokens that were fed), and its size."""

    token_ids: tuple
    cache: object
    nbytes: int


class PrefixCache:
    """Entries by token ids, least recently used first; their caches together hold at most budget_bytes."""

    def __init__(self, budget_bytes, measure=cache_bytes):
        self.budget_bytes = budget_bytes
        self.measure = measure
        self.entries = OrderedDict()  # token ids -> Entry, oldest first

    @property
    def nbytes(self):
        return sum(entry.nbytes for entry in self.entries.values())

    def __len__(self):
        return len(self.entries)

    def take(self, token_ids):
        """The entry with the longest token ids that token_ids starts with, removed from the cache; else None."""
        token_ids = tuple(token_ids)
        best = None
        for key in self.entries:
            if len(key) <= len(token_ids) and token_ids[: len(key)] == key and (best is None or len(key) > len(best)):
                best = key
        return None if best is None else self.entries.pop(best)

    def put(self, token_ids, cache):
        """Keep cache as holding token_ids (most recently used), evicting the oldest entries past the budget.

        A cache larger than the whole budget is dropped. Returns the token ids of evicted entries.
        """
        if not token_ids:
            return []
        entry = Entry(tuple(token_ids), cache, self.measure(cache))
        self.entries.pop(entry.token_ids, None)
        if entry.nbytes > self.budget_bytes:
            return [entry.token_ids]
        self.entries[entry.token_ids] = entry
        evicted = []
        while self.nbytes > self.budget_bytes:
            evicted.append(self.entries.popitem(last=False)[0])
        return evicted
