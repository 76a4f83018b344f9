"""scripts/train_prose_long_context.sh end to end, tiny: data mixes, the five training stages, the
needle and held-out-loss evaluations and the collected results, on a stand-in corpus."""

import json
import os
import subprocess
from pathlib import Path

from tests.prose_corpus import write_corpus

REPO = Path(__file__).resolve().parent.parent

TINY = {
    "ATTNS": "ann", "INDUCTION_STEPS": "2", "COPY_STEPS": "2", "NEEDLE_STEPS": "2", "DISTRACT_STEPS": "2",
    "MULTIKEY_STEPS": "3",
    "HIDDEN": "32", "LAYERS": "2", "BATCH": "2", "COPY_DOCS": "20", "NEEDLE_COPY_DOCS": "10",
    "EVAL_LENGTHS": "1024", "EVAL_TRIALS": "1", "PPL_TOKENS": "1024", "THREADS": "1",
}


def run_recipe(tmp_path, **settings):
    env = {**os.environ, **TINY, "DATA_DIR": str(write_corpus(tmp_path / "corpus")), "PROSE": str(tmp_path / "data"),
           "OUT": str(tmp_path / "out"), **settings}
    return subprocess.run(["bash", "scripts/train_prose_long_context.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_default_recipe_trains_all_three_needle_tasks_and_reports_them(tmp_path):
    done = run_recipe(tmp_path, MULTIKEY_TASKS="multikey multivalue")
    assert done.returncode == 0, done.stdout + done.stderr
    # The defaults are the recipe docs/LONG_CONTEXT.md reports: three-token keys from stage 1 on,
    # blocks selected by their best key, the HNSW settings of the evaluations saved with the model.
    config = json.loads((tmp_path / "out" / "prose_ann" / "model" / "config.json").read_text())
    assert (config["key_shift"], config["query_shift"], config["ann_block_summary"]) == (3, 2, "keys")
    assert (config["hnsw_ef_search"], config["hnsw_keys_per_head"]) == (32, 32)
    assert config["ann_retrieval_layers"] == [1] and config["ann_batch_distractors"]
    mix = json.loads((tmp_path / "data" / "needles" / "prose_data.json").read_text())
    assert set(mix["needle_documents_by_task"]) == {"single", "multikey", "multivalue"}
    assert mix["args"]["needle_min_tokens"] == 280
    copy_mix = json.loads((tmp_path / "data" / "copy" / "prose_data.json").read_text())
    assert set(copy_mix["needle_documents_by_task"]) == {"single"} and copy_mix["args"]["needle_min_tokens"] == 112
    multikey_mix = json.loads((tmp_path / "data" / "multikey" / "prose_data.json").read_text())
    assert set(multikey_mix["needle_documents_by_task"]) == {"multikey", "multivalue"}
    # Stages 3 and 4 (2 steps each) stay in stages/, stage 5 (3 steps, from stage 4's model) is the model.
    stages = tmp_path / "out" / "prose_ann" / "stages"
    for stage, steps in (("needles", 2), ("distractors", 2)):
        assert json.loads((stages / stage / "metrics.jsonl").read_text().splitlines()[-1])["step"] == steps
    assert f"starting from {stages / 'distractors' / 'model'})" in (tmp_path / "out" / "prose_ann.log").read_text()
    last_stage = [json.loads(line) for line in (tmp_path / "out" / "prose_ann" / "metrics.jsonl").read_text().splitlines()]
    assert last_stage[-1]["step"] == 3
    results = tmp_path / "out" / "results"
    needles = json.loads((results / "needles.json").read_text())["rows"]
    assert {row["task"] for row in needles} == {"single", "multikey", "multivalue"}
    perplexity = json.loads((results / "perplexity.json").read_text())["rows"]
    assert {row["variant"] for row in perplexity} == {"retrieval", "window_only"}


def test_needle_documents_shorter_than_the_longest_template_stop_the_recipe(tmp_path):
    done = run_recipe(tmp_path, NEEDLE_TASKS="multikey", NEEDLE_MIN_TOKENS="112")
    assert done.returncode != 0
    assert "--needle_min_tokens 112 is shorter than the en multikey template" in done.stderr
    assert not (tmp_path / "out" / "prose_ann").exists()


def test_a_mix_built_with_other_settings_is_built_again(tmp_path):
    for mix in ("copy", "needles"):  # newer than the code, but from other flags
        folder = tmp_path / "data" / mix
        folder.mkdir(parents=True)
        (folder / "prose_train.jsonl").write_text("{}\n")
        (folder / "build_flags").write_text("--tasks single\n")
    done = run_recipe(tmp_path, NEEDLE_TASKS="multikey", NEEDLE_MIN_TOKENS="112")
    assert "--needle_min_tokens 112 is shorter than the en multikey template" in done.stderr
    copy_mix = json.loads((tmp_path / "data" / "copy" / "prose_data.json").read_text())
    assert copy_mix["needle_documents_by_task"] == {"single": copy_mix["needle_documents"]}
