"""ANN attention is causal and chunk-invariant for every retriever, at lengths where HNSW holds
hundreds of blocks.

Causal: changing the tokens after position t leaves every output at <= t unchanged. Chunk-invariant:
a prompt prefilled through the cache in chunks of any size gives the logits and greedy tokens of
one whole-prompt call. Both fail if a query's blocks depend on blocks that are not candidates for
it (a graph grown past them, a retriever switched on the call's largest limit).

The HNSW settings are far below the defaults, so that recall is well below 1 and an answer that
depended on the graph's shape beyond the query's own blocks would show.
"""

import pytest
import torch

from model.ann_attention import MASKED_SDPA_MAX_LEN
from tests.test_ann_attention import ann_model  # window 16, blocks of 8, 4 query and 2 KV heads

VOCAB = 64
AUTO_THRESHOLD = 40  # candidate blocks: crossed at position 16 + 39 * 8 = 328, inside every sequence below


def tiny_model(retrieval, summary, block_position, layers, key_shift=0):
    return ann_model(
        retrieval,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        ann_top_n=3,
        ann_block_summary=summary,
        ann_block_position=block_position,
        key_shift=key_shift,
        ann_auto_threshold=AUTO_THRESHOLD,
        hnsw_m=4,
        hnsw_ef_construction=16,
        hnsw_ef_search=8,
    )


def random_tokens(length, seed):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


RETRIEVALS = ["exact", "hnsw", "auto", "pruned"]
retrievers = pytest.mark.parametrize("retrieval", RETRIEVALS)
# "keys" cannot be pruned by super-block bounds
KEY_RETRIEVALS = ["exact", "hnsw", "auto"]
retrievals_and_summaries = pytest.mark.parametrize(
    "retrieval,summary", [(r, s) for r in RETRIEVALS for s in ("bounds", "mean")] + [(r, "keys") for r in KEY_RETRIEVALS]
)
block_positions = pytest.mark.parametrize("block_position", ["capped", "true"])


@retrievals_and_summaries
@block_positions
@pytest.mark.parametrize(
    "length",
    [700, 2100],
    ids=lambda length: f"{'masked' if length <= MASKED_SDPA_MAX_LEN else 'tiled'}-{length}",
)
@torch.inference_mode()
def test_later_tokens_leave_earlier_outputs_unchanged(retrieval, summary, block_position, length):
    """Full forwards without cache; 700 tokens take the masked-SDPA path (85 blocks), 2100 the tiled
    path (260 blocks)."""
    model = tiny_model(retrieval, summary, block_position, layers=1)
    tokens = random_tokens(length, seed=length)
    logits = model(tokens).logits
    for t in (length // 5, length // 2, length - 40):
        changed = tokens.clone()
        changed[:, t + 1 :] = random_tokens(length - t - 1, seed=t)
        changed_logits = model(changed).logits
        assert (changed_logits[:, : t + 1] - logits[:, : t + 1]).abs().max().item() <= 1e-6, f"t={t}"
        assert (changed_logits[:, t + 1 :] - logits[:, t + 1 :]).abs().max().item() > 1e-3  # the change is seen


def prefill_and_decode(model, prompt, chunk, new_tokens):
    """prompt (1, s) through the cache in calls of `chunk` tokens, then greedy decoding
    -> (prompt logits (1, s, vocab), greedy tokens (new_tokens,))."""
    cache = model.new_cache(reserve=prompt.shape[1] + new_tokens)
    pieces = [model(part, cache=cache, use_cache=True).logits for part in prompt.split(chunk, dim=1)]
    logits = torch.cat(pieces, dim=1)
    tokens, last = [], logits[:, -1]
    for _ in range(new_tokens):
        tokens.append(last.argmax(dim=-1))
        last = model(tokens[-1][:, None], cache=cache, use_cache=True).logits[:, -1]
    return logits, torch.cat(tokens)


PROMPT_LENGTH = 480  # 58 candidate blocks for the last prompt token


@pytest.mark.parametrize("retrieval,summary", [(r, "bounds") for r in RETRIEVALS] + [(r, "keys") for r in KEY_RETRIEVALS])
@block_positions
@pytest.mark.parametrize("chunk", [1, 7, 100], ids=lambda chunk: f"chunk{chunk}")
@torch.inference_mode()
def test_prefill_chunk_size_changes_no_logit_and_no_greedy_token(retrieval, summary, block_position, chunk):
    """Two layers: the second layer's keys come from outputs that each chunk size computes on its
    own path (masked SDPA, tiles, single-token steps). Bounds for every retrieval, and "keys", whose
    summaries are the cache's keys themselves (the causality grid runs mean too).

    Capped keys are unrotated, so under "keys" two blocks whose best key is the same token tie
    exactly, and torch.topk's choice among tied blocks may differ between call shapes; with keys
    that mix the two previous tokens in, a tie needs a repeated 3-gram."""
    model = tiny_model(retrieval, summary, block_position, layers=2, key_shift=2 if summary == "keys" else 0)
    prompt = random_tokens(PROMPT_LENGTH, seed=1)
    whole_logits, whole_tokens = prefill_and_decode(model, prompt, PROMPT_LENGTH, 8)
    logits, tokens = prefill_and_decode(model, prompt, chunk, 8)
    assert (logits - whole_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, whole_tokens)
