"""The ANN figure and ablation scripts run end to end at tiny sizes and write valid outputs.

Both run in-process (main(argv)): a subprocess would pay the torch/transformers/faiss imports again.
"""

import json

import pytest

from benchmarks import ablate_ann
from scripts import plot_ann_pattern

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_pattern_figure(tmp_path):
    out = tmp_path / "pattern.png"
    plot_ann_pattern.main(["--out", str(out), "--length", "64", "--window", "16", "--block_size", "4"])
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert out.stat().st_size < 150_000


def test_ablation_rows(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog ran to the park. " * 200)
    json_path, png_path = tmp_path / "ablation.json", tmp_path / "ablation.png"
    configs = ["dense", "16,8,1", "16,8,1@1"]
    ablate_ann.main(
        ["--data", str(text), "--steps", "2", "--seq_len", "64", "--batch_size", "2", "--val_windows", "2",
         "--hidden_size", "32", "--layers", "1", "--configs", *configs, "--json", str(json_path), "--png", str(png_path)]
    )
    report = json.loads(json_path.read_text())
    assert report["config"]["steps"] == 2
    rows = report["rows"]
    assert [(row["attn"], row["window"], row["block"], row["top_n"], row["seed"]) for row in rows] == [
        ("dense", None, None, None, 0), ("ann", 16, 8, 1, 0), ("ann", 16, 8, 1, 1),
    ]
    for row in rows:
        assert 0 < row["val_loss"] < 20 and row["tokens_per_s"] > 0 and row["steps"] == 2
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)


def test_bad_config_is_a_usage_error():
    with pytest.raises(SystemExit):
        ablate_ann.parse_args(["--configs", "64,16"])
