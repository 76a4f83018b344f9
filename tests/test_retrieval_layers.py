"""ann_retrieval_layers: the listed decoder layers retrieve blocks, the others attend to their window
only (top_n 0), as DuoAttention's streaming heads. Selection settings change no weights, so one set
of weights runs with any list."""

import pytest
import torch

from model.hnsw import HnswRetriever
from tests.test_ann_attention import ann_model  # window 16, blocks of 8, 4 query and 2 KV heads
from tests.test_causality import prefill_and_decode, random_tokens

VOCAB = 64
LAYERS = 3
LENGTH = 300  # 36 candidate blocks for the last token: top 3 of them is a real choice


def three_layer_model(retrieval_layers, retrieval="exact", summary="bounds", top_n=3):
    """The same weights (seeded) for every argument; HNSW settings far below the defaults."""
    return ann_model(
        retrieval, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, ann_top_n=top_n,
        ann_block_summary=summary, ann_retrieval_layers=retrieval_layers, key_shift=2 if summary == "keys" else 0,
        hnsw_m=4, hnsw_ef_construction=16, hnsw_ef_search=8,
    )


@torch.inference_mode()
def test_only_the_listed_layers_retrieve():
    tokens = random_tokens(LENGTH, seed=3)
    every = three_layer_model(None)
    assert [layer.self_attn.core.top_n for layer in three_layer_model([1]).model.layers] == [0, 3, 0]
    listed_all = three_layer_model(list(range(LAYERS)))(tokens).logits
    none_listed = three_layer_model([])(tokens).logits
    window_only = three_layer_model(None, top_n=0)(tokens).logits
    middle = three_layer_model([1])(tokens).logits
    by_hand = three_layer_model(None)
    for index in (0, 2):
        by_hand.model.layers[index].self_attn.core.top_n = 0
    assert (listed_all - every(tokens).logits).abs().max().item() <= 1e-6
    assert (none_listed - window_only).abs().max().item() <= 1e-6
    assert (middle - by_hand(tokens).logits).abs().max().item() <= 1e-6
    # Retrieval acts: one retrieving layer gives neither every layer's logits nor the window's.
    assert (middle - listed_all).abs().max().item() > 1e-3
    assert (middle - window_only).abs().max().item() > 1e-3


@pytest.mark.parametrize("retrieval,summary", [("exact", "bounds"), ("hnsw", "bounds"), ("exact", "keys"), ("hnsw", "keys")])
@pytest.mark.parametrize("chunk", [1, 37], ids=lambda chunk: f"chunk{chunk}")
@torch.inference_mode()
def test_cached_prefill_and_decoding_equal_one_call_and_grow_graphs_only_where_retrieved(retrieval, summary, chunk):
    """A prompt prefilled in chunks and then decoded gives the whole-prompt call's logits and tokens;
    the layers left out keep no HNSW graphs."""
    model = three_layer_model([1], retrieval, summary)
    prompt = random_tokens(LENGTH, seed=4)
    whole_logits, whole_tokens = prefill_and_decode(model, prompt, LENGTH, 6)
    logits, tokens = prefill_and_decode(model, prompt, chunk, 6)
    assert (logits - whole_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, whole_tokens)
    if retrieval == "hnsw":
        cache = model.new_cache(reserve=LENGTH)
        model(prompt, cache=cache, use_cache=True)
        model(prompt[:, :1], cache=cache, use_cache=True)  # one decoding step
        assert [isinstance(layer.retriever, HnswRetriever) for layer in cache.layers] == [False, True, False]
        assert all(len(graph) for graph in cache.layers[1].retriever.graphs[0])
