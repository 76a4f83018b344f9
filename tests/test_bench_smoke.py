"""The benchmark scripts end to end at tiny sizes: they run, and write the documented JSON and a PNG.

Each script runs as a real subprocess (as a file or with -m, as the docs show both), one thread.
Numbers are not checked: at these sizes they are noise.
"""

import json
import subprocess
import sys
from pathlib import Path

import faiss
import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM
from benchmarks import bench_retrieval
from benchmarks.common import Extrapolator, skip_reason

REPO_ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_script(args, returncode=0):
    result = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == returncode, result.stdout + result.stderr
    return result.stdout + result.stderr


def load_outputs(json_path):
    assert json_path.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
    report = json.loads(json_path.read_text())
    assert isinstance(report["config"], dict) and report["rows"]
    return report


def test_bench_attention(tmp_path):
    json_path = tmp_path / "attention.json"
    run_script(["benchmarks/bench_attention.py", "--lengths", "128", "256", "--decode_lengths", "256", "--repeats", "1",
                "--decode_steps", "2", "--threads", "1", "--json", str(json_path)])
    report = load_outputs(json_path)
    measured = {(row["impl"], row["mode"], row["seq_len"]) for row in report["rows"]}
    impls = ["dense", "ann_exact", "ann_hnsw", "ann_auto"]
    expected = {(i, m, n) for i in impls for m in ("fwd", "fwd_bwd") for n in (128, 256)}
    expected |= {(i, "decode", 256) for i in impls}
    assert measured == expected and report["skipped"] == []
    for row in report["rows"]:
        assert row["ms"] > 0 and isinstance(row["peak_mb"], float)
    decode = [row for row in report["rows"] if row["mode"] == "decode"]
    assert all(row["kv_cache_mb"] == 2 * 2 * 256 * 64 * 4 / 2**20 for row in decode)


def test_rows_are_skipped_when_their_extrapolated_cost_is_over_the_limits():
    estimates = Extrapolator()
    assert estimates.predict("dense", 1024) is None  # nothing measured: the row runs
    estimates.add("dense", 1024, 1.0)
    assert estimates.predict("dense", 2048) == 4.0  # one point: quadratic, the cautious guess
    estimates.add("dense", 2048, 2.0)
    assert estimates.predict("dense", 8192) == 8.0  # fitted: linear
    assert skip_reason(8.0, max_row_s=10) is None
    assert "--max_row_s" in skip_reason(8.0, max_row_s=5)
    assert "--mem_limit_gb" in skip_reason(1.0, 10, estimated_mb=3000, mem_limit_gb=2)


def test_bench_train(tmp_path):
    json_path = tmp_path / "train.json"
    run_script(["-m", "benchmarks.bench_train", "--lengths", "64", "128", "--tokens_per_step", "256", "--warmup", "1",
                "--steps", "1", "--threads", "1", "--json", str(json_path)])
    report = load_outputs(json_path)
    assert {(row["impl"], row["seq_len"]) for row in report["rows"]} == {
        (impl, n) for impl in ("dense", "ann_exact") for n in (64, 128)
    }
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and isinstance(row["peak_mb"], float)
        assert row["batch"] * row["seq_len"] == 256


def check_retrieval_report(report, blocks, ef_values):
    for m in blocks:
        exact = [r for r in report["rows"] if r["blocks"] == m and r["impl"] == "exact"]
        hnsw = [r for r in report["rows"] if r["blocks"] == m and r["impl"] == "hnsw"]
        assert len(exact) == 1 and exact[0]["recall"] == 1.0
        assert sorted(r["ef_search"] for r in hnsw) == sorted(ef_values)
        for row in exact + hnsw:
            assert row["decode_ms"] > 0 and row["prefill_ms"] > 0 and 0 <= row["recall"] <= 1
    assert set(report["crossover"]) == {"decode", "prefill"}
    assert "recommended_ann_auto_threshold" in report


def test_bench_retrieval_synthetic_keys(tmp_path):
    json_path = tmp_path / "retrieval.json"
    out = run_script(["benchmarks/bench_retrieval.py", "--blocks", "64", "256", "--ef_sweep", "16",
                      "--decode_queries", "5", "--prefill_queries", "16", "--prefill_repeats", "1", "--threads", "1",
                      "--json", str(json_path)])
    check_retrieval_report(load_outputs(json_path), [64, 256], [64, 16])
    assert "recommended ann_auto_threshold" in out


def test_bench_retrieval_selection_by_the_best_key(tmp_path):
    """--summary keys: graphs over keys. 8 blocks of 8 are 64 keys per head, and asking each head for
    64 keys at efSearch 64 finds them all, so the re-scored answer is exact's (recall 1)."""
    json_path = tmp_path / "retrieval_keys.json"
    run_script(["benchmarks/bench_retrieval.py", "--summary", "keys", "--head_dim", "16", "--block_size", "8",
                "--blocks", "8", "32", "--keys_per_head", "64", "--ef_sweep", "16", "--decode_queries", "5",
                "--prefill_queries", "16", "--prefill_repeats", "1", "--threads", "1", "--json", str(json_path)])
    report = load_outputs(json_path)
    check_retrieval_report(report, [8, 32], [64, 16])
    assert report["config"]["summary"] == "keys"
    assert next(r for r in report["rows"] if r["blocks"] == 8 and r["ef_search"] == 64)["recall"] == 1.0
    refused = run_script(["benchmarks/bench_retrieval.py", "--summary", "keys", "--blocks", "8", "--shards", "2",
                          "--json", str(tmp_path / "refused.json")], returncode=2)
    assert "does not serve 'keys' selection" in refused


def test_bench_retrieval_sharded_graphs_merge_to_the_exact_top_n(tmp_path):
    """64 blocks over 1 and 3 shards: each shard's graph holds at most 64 nodes, fewer than efSearch 64,
    so its search sees every block and the merged answer must be the exact one (recall 1)."""
    json_path = tmp_path / "retrieval.json"
    out = run_script(["benchmarks/bench_retrieval.py", "--blocks", "64", "--shards", "1", "3", "--ef_sweep", "16",
                      "--decode_queries", "5", "--prefill_queries", "16", "--prefill_repeats", "1", "--threads", "1",
                      "--json", str(json_path)])
    sharded = load_outputs(json_path)["sharded"]
    assert sorted((row["shards"], row["ef_search"]) for row in sharded) == [(1, 16), (1, 64), (3, 16), (3, 64)]
    for row in sharded:
        assert row["blocks"] == 64 and row["prefill_ms"] > 0 and row["build_ms"] > 0 and 0 <= row["recall"] <= 1
    assert all(row["recall"] == 1.0 for row in sharded if row["ef_search"] == 64)
    assert "HNSW per shard, merged" in out


def save_tiny_ann_model_and_text(tmp_path, lines):
    """-> (model folder, text file): a fresh 2-layer ANN model (blocks of 8) and `lines` lines of text."""
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            attn_impl="ann", ann_window=16, ann_block_size=8, ann_top_n=2)
    MiniMindForCausalLM(config).save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(lines)))
    return tmp_path / "model", text


def test_bench_retrieval_model_keys(tmp_path):
    model, text = save_tiny_ann_model_and_text(tmp_path, 300)
    json_path = tmp_path / "retrieval.json"
    threads, faiss_threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    try:
        bench_retrieval.main(["--model", str(model), "--text", str(text), "--model_tokens", "1200",
                              "--blocks", "16", "64", "1000", "--ef_sweep", "--decode_queries", "4",
                              "--prefill_queries", "8", "--prefill_repeats", "1", "--threads", "1",
                              "--json", str(json_path)])
    finally:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(faiss_threads)
    report = load_outputs(json_path)
    assert sorted({row["blocks"] for row in report["rows"]}) == [16, 64]  # 1000 blocks need more tokens: skipped
    check_retrieval_report(report, [16, 64], [64])
    assert report["config"]["keys"].startswith("model")


def test_bench_selection_synthetic_keys(tmp_path):
    json_path = tmp_path / "selection.json"
    run_script(["benchmarks/bench_selection.py", "--blocks", "2048", "--keys", "random", "needle", "--summary", "bounds",
                "--queries", "64", "--repeats", "1", "--threads", "1", "--json", str(json_path)])
    rows = json.loads(json_path.read_text())["rows"]
    assert [(row["keys"], row["blocks"]) for row in rows] == [("random", 2048), ("needle", 2048)]
    assert all(row["agree"] for row in rows)
    needle, random = rows[1], rows[0]
    assert needle["exact_fraction"] < random["exact_fraction"], "a standout block prunes the rest"


def test_bench_selection_model_keys(tmp_path):
    model, text = save_tiny_ann_model_and_text(tmp_path, 100)
    json_path = tmp_path / "selection.json"
    out = run_script(["benchmarks/bench_selection.py", "--model", str(model), "--text", str(text),
                      "--tokens", "400", "800", "--chunk", "256", "--min_blocks", "0", "--repeats", "1",
                      "--threads", "1", "--json", str(json_path)])
    rows = json.loads(json_path.read_text())["rows"]
    assert [(row["tokens"], row["blocks"]) for row in rows] == [(400, 50), (800, 100)], out
    assert all(row["agree"] and row["keys"] == "model:text" for row in rows)
    assert all(0 < row["exact_fraction"] <= 1.5 for row in rows), "the pruned calls were counted"
    result = subprocess.run([sys.executable, "benchmarks/bench_selection.py", "--model", str(model),
                             "--text", str(text), "--tokens", "100000"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "fewer than --tokens 100000" in result.stderr


def test_bench_bounds_model_keys(tmp_path):
    model, text = save_tiny_ann_model_and_text(tmp_path, 100)
    json_path = tmp_path / "bounds.json"
    run_script(["benchmarks/bench_bounds.py", "--model", str(model), "--text", str(text), "--tokens", "800",
                "--layers", "1", "--queries", "64", "--group_blocks", "1", "4", "--threads", "1", "--json", str(json_path)])
    rows = json.loads(json_path.read_text())["rows"]
    assert {(row["group_blocks"], row["grouping"]) for row in rows} == {
        (size, grouping) for size in (1, 4) for grouping in ("positional", "kmeans")}
    # A query group's queries all score the union it opens: their candidates differ by at most
    # query_group / block_size blocks, so the union's share may pass 1 by that much.
    assert all(0 < row["per_query"] <= row["per_query_group"] <= 1 + 64 / 8 / 90 for row in rows)
    # A group of one block bounds its score exactly: a query opens its top_n blocks, and others only
    # where they tie with its n-th best (the text repeats, so some blocks are equal).
    limits = torch.arange(800 - 64, 800).sub(16).div(8, rounding_mode="floor").add(1)
    top_n_share = 64 * 2 / limits.sum().item()
    for row in rows:
        if row["group_blocks"] == 1 and row["grouping"] == "positional":
            assert top_n_share <= row["per_query"] <= 1.1 * top_n_share


def test_bench_serving(tmp_path):
    json_path = tmp_path / "serving.json"
    out = run_script(["benchmarks/bench_serving.py", "--lengths", "64", "160", "--turn_tokens", "8", "--concurrency",
                      "1", "2", "--stream_prompt", "16", "--stream_tokens", "4", "--threads", "1",
                      "--json", str(json_path)])
    report = load_outputs(json_path)
    first = [row for row in report["rows"] if row["kind"] == "first_token"]
    assert [row["history"] for row in first] == [64, 160]
    assert all(row["ttft_cached_s"] > 0 and row["ttft_uncached_s"] > 0 for row in first)
    streams = [row for row in report["rows"] if row["kind"] == "concurrency"]
    assert [(row["streams"], row["tokens"]) for row in streams] == [(1, 4), (2, 8)]
    assert "ttft cached s" in out


@pytest.mark.parametrize("retrieval", ["exact", "hnsw"])
def test_bench_context_parallel(tmp_path, retrieval):
    json_path = tmp_path / "context_parallel.json"
    run_script(["benchmarks/bench_context_parallel.py", "--length", "256", "--ranks", "1", "2", "--decode_steps", "2",
                "--retrieval", retrieval, "--json", str(json_path)])
    report = load_outputs(json_path)
    assert report["config"]["retrieval"] == retrieval and {row["retrieval"] for row in report["rows"]} == {retrieval}
    assert [(row["world"], row["rank"]) for row in report["rows"]] == [(1, 0), (2, 0), (2, 1)]
    assert all(row["prefill_s"] > 0 and row["decode_ms"] > 0 for row in report["rows"])
    assert [row["bytes_per_token"] > 0 for row in report["rows"]] == [False, True, True]
    assert [row["machines"] for row in report["plan"]] == [64, 256, 1024]


def test_profile_ann_forward_parts_add_up(tmp_path):
    json_path = tmp_path / "parts.json"
    out = run_script(["benchmarks/profile_ann_forward.py", "--lengths", "1536", "2048", "--window", "32", "--repeats", "1",
                      "--threads", "1", "--json", str(json_path)])
    rows = json.loads(json_path.read_text())["rows"]
    assert [row["seq_len"] for row in rows] == [1536, 2048]  # past 1024 queries: the tiled path
    for row in rows:
        parts = [row[f"{part}_ms"] for part in ("queries", "selection", "gather", "attend", "rest")]
        assert all(part >= 0 for part in parts) and row["selection_ms"] > 0 and row["attend_ms"] > 0
        assert abs(sum(parts) - row["profiled_ms"]) <= 1e-6 * row["profiled_ms"] + 1e-9
        assert row["dense_ms"] > 0 and row["ratio"] > 0
    assert "without selection / dense" in out
