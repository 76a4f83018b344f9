"""The FlexAttention baselines (benchmarks/flex_cores.py) against the project's own cores.

flex_ann expresses ANN attention with true positions as a block-sparse mask and runs torch's
flex_attention kernel, written independently of model/ann_attention.py's tiles and masked SDPA:
its outputs equal AnnAttention's (exact retrieval) over a grid of lengths (both AnnAttention paths:
masked SDPA up to 1024 queries, tiles beyond), windows, top_n, GQA groups and summaries. Eager
flex_attention (no compilation) in float64; the bench compiles it.
"""

import warnings

import pytest
import torch

from benchmarks import bench_attention, flex_cores
from benchmarks.flex_cores import FlexCore, touched_tiles
from model.ann_attention import AnnAttention
from model.config import MiniMindConfig
from model.dense_attention import DenseAttention
from model.rope import Rope

HEAD_DIM = 16


def inputs(length, heads, kv_heads, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, HEAD_DIM, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, length, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    return q, k, v, Rope(torch.arange(length)[None], HEAD_DIM, 1e4, torch.float64)


def config(heads, kv_heads, window, top_n, summary):
    return MiniMindConfig(hidden_size=heads * HEAD_DIM, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          num_hidden_layers=1, ann_window=window, ann_block_size=16, ann_top_n=top_n,
                          ann_block_position="true", ann_retrieval="exact", ann_block_summary=summary)


def eager(core, *args):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return core(*args)


@pytest.mark.parametrize("summary", ["bounds", "mean"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window,top_n", [(16, 1), (32, 3), (64, 4)])
@pytest.mark.parametrize("length", [200, 700, 1100])
def test_flex_ann_equals_ann_attention_with_true_positions(length, window, top_n, heads, kv_heads, summary):
    q, k, v, rope = inputs(length, heads, kv_heads, seed=length + window)
    settings = config(heads, kv_heads, window, top_n, summary)
    reference = AnnAttention(settings)(q, k, v, None, None, None, rope)
    core = FlexCore(settings, "ann", compiled=False)
    out = eager(core, q, k, v, None, None, None, rope)
    assert (out - reference).abs().max().item() <= 1e-10
    dense = DenseAttention(settings)(q, k, v, None, None, None, rope)
    assert (out - dense).abs().max().item() > 0.1  # the test tells ANN from dense attention
    assert 0 < core.tile_fraction <= 1


def test_flex_causal_equals_dense_attention():
    q, k, v, rope = inputs(300, 8, 2, seed=1)
    settings = config(8, 2, 32, 2, "bounds")
    out = eager(FlexCore(settings, "causal", compiled=False), q, k, v, None, None, None, rope)
    assert (out - DenseAttention(settings)(q, k, v, None, None, None, rope)).abs().max().item() <= 1e-10


def test_touched_tiles_list_the_window_and_every_selected_block():
    """Length 300 -> 3 tiles of 128; a query's window reaches back into the previous tile."""
    block_ids = torch.zeros(1, 1, 300, 1, dtype=torch.long)
    valid = torch.zeros(1, 1, 300, 1, dtype=torch.bool)
    block_ids[0, 0, 299, 0], valid[0, 0, 299, 0] = 9, True  # block 9: keys 144-159, key tile 1
    touched = touched_tiles(block_ids, valid, 300, 32, 16)[0, 0]
    assert touched.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown FlexAttention pattern"):
        FlexCore(config(4, 2, 32, 2, "bounds"), "sliding")
    with pytest.raises(ValueError, match="must divide the kernel tile"):
        FlexCore(MiniMindConfig(ann_block_size=24, ann_window=48), "ann")
    q, k, v, rope = inputs(64, 4, 2, seed=0)
    with pytest.raises(ValueError, match="whole sequences"):
        FlexCore(config(4, 2, 32, 2, "bounds"), "ann", compiled=False)(q, k, v, torch.zeros(1), None, None, rope)


def test_bench_rows_of_the_flex_baselines(monkeypatch):
    """The bench's flex rows in this process, the kernel eager: a fwd row reports the key tiles its
    mask lists against a causal mask's; decode and (on CPU) fwd_bwd rows are skipped with their reason."""
    monkeypatch.setattr(flex_cores, "flex_kernel", lambda compiled: flex_cores.flex_attention)
    settings = vars(bench_attention.parse_args(["--head_dim", "16", "--threads", "1"]))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        row = bench_attention.measure_memory(settings, "flex_ann", mode="fwd", length=512)
    assert row["peak_mb"] >= 0 and 0 < row["tiles_vs_causal"] <= 1  # random keys: every tile is touched
    assert "no KV cache" in bench_attention.flex_reason_to_skip("flex_ann", "decode", "cpu")
    assert "backward on CPU" in bench_attention.flex_reason_to_skip("flex_causal", "fwd_bwd", "cpu")
    assert bench_attention.flex_reason_to_skip("flex_ann", "fwd_bwd", "cuda") is None
    assert bench_attention.flex_reason_to_skip("ann_exact", "decode", "cpu") is None
