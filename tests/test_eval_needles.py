"""The prose recipe end to end at toy size: a few training steps on the prose mix, then
scripts/eval_needles.py (every task and language, exact and HNSW, JSON and PNG),
scripts/eval_perplexity.py (loss by position bucket for retrieval, window only and dense),
scripts/probe_repeats.py (loss on held-out passages read again) and scripts/probe_selection.py
(where selection ranks the needle's block)."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evaluation.loading import load_model
from evaluation.copying import repeated_passage_losses
from scripts import collect_long_context, eval_needles, eval_perplexity, make_prose_data, probe_repeats, probe_selection
from tests.prose_corpus import write_corpus
from tests.torchrun_launch import torchrun
from trainer import train_pretrain

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = REPO_ROOT / "model" / "tokenizer_prose"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prose_dir(corpus_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("prose")
    assert make_prose_data.main(["--data_dir", str(corpus_dir), "--out_dir", str(out_dir), "--tokenizer", str(TOKENIZER),
                                 "--chunk_tokens", "120", "--needle_min_tokens", "300", "--needle_max_tokens", "320"]) == 0
    return out_dir


@pytest.fixture(scope="module")
def trained(prose_dir, tmp_path_factory):
    """A ~0.3M-parameter ANN model after 4 steps of the recipe's flags on the toy mix."""
    out_dir = tmp_path_factory.mktemp("prose_ann")
    argv = ["--out_dir", str(out_dir), "--data_path", str(prose_dir / "prose_train.jsonl"), "--tokenizer_path",
            str(TOKENIZER), "--attn", "ann", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "4",
            "--num_key_value_heads", "2", "--rope_theta", "10000", "--ann_window", "16", "--ann_top_n", "2",
            "--key_shift", "2", "--query_shift", "1", "--wide_shift_from_step", "2", "--hnsw_ef_search", "48",
            "--max_seq_len", "128", "--batch_size", "4", "--accumulation_steps", "1", "--learning_rate", "3e-3",
            "--max_steps", "4", "--log_interval", "1", "--save_interval", "100", "--seed", "7"]
    train_pretrain.main(train_pretrain.STAGE, argv)
    return out_dir / "model"


def test_training_on_the_prose_mix_writes_a_model(trained):
    records = [json.loads(line) for line in (trained.parent / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4 and all(record["loss"] > 0 for record in records)
    saved, prose = (json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")) for folder in (trained, TOKENIZER))
    assert saved["model"]["vocab"] == prose["model"]["vocab"] and saved["pre_tokenizer"] == prose["pre_tokenizer"]


def test_eval_needles_writes_rows_per_task_and_retrieval(trained, corpus_dir, tmp_path, capsys):
    json_path = tmp_path / "needles.json"
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300",
                              "--tasks", "multikey", "multivalue", "--langs", "zh", "--trials", "1", "--prefill_chunk", "128", "--json", str(json_path)]) == 0
    result = json.loads(json_path.read_text())
    rows, trials = result["rows"], result["trials"]
    keys = [(r["task"], r["lang"], r["length"], r["retrieval"]) for r in rows]
    assert sorted(keys) == sorted((task, lang, length, retrieval) for task in ("multikey", "multivalue")
                                  for lang in ("zh",) for length in (300,) for retrieval in ("exact", "hnsw"))
    for row in rows:
        group = [t for t in trials if all(t[k] == row[k] for k in ("task", "lang", "length", "retrieval"))]
        assert row["trials"] == len(group) == 1 and row["needle_seed"] == 0
        assert row["seed"] == json.loads((trained / "training_args.json").read_text())["seed"] == 7
        assert row["accuracy"] == group[0]["correct"]
        assert row["answered_other_key"] == group[0]["answered_other_key"] <= 1 - row["accuracy"]
        assert row["prefill_seconds"] > 0 and row["answer_seconds"] >= 0 and row["peak_rss_mb"] > 0
    for trial in trials:
        assert (len(trial["other_values"]) > 0) == (trial["task"] == "multikey")
        assert abs(trial["prompt_tokens"] - trial["length"]) <= 40 and trial["heldout_tokens"] > 0
    # The same prompts for both retrievals: same needles per (task, lang, length, depth).
    by_retrieval = {r: [(t["task"], t["lang"], t["length"], t["depth"], t["values"]) for t in trials if t["retrieval"] == r]
                    for r in ("exact", "hnsw")}
    assert by_retrieval["exact"] == by_retrieval["hnsw"]
    assert json_path.with_suffix(".png").read_bytes()[:8] == PNG
    assert "multivalue" in capsys.readouterr().out


def test_dense_model_skips_lengths_past_its_cap(trained, corpus_dir, tmp_path, capsys, monkeypatch):
    json_path = tmp_path / "dense.json"
    original = eval_needles.load_model
    monkeypatch.setattr(eval_needles, "load_model",
                        lambda path, attn, retrieval, device, overrides=None: original(path, "dense", None, device))
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "600",
                              "--tasks", "single", "--langs", "en", "--trials", "1", "--dense_max_length", "400",
                              "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    assert [(row["length"], row["retrieval"]) for row in rows] == [(300, None)]


def test_a_repeated_passage_haystack_is_recorded(trained, corpus_dir, tmp_path):
    json_path = tmp_path / "repeated.json"
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300",
                              "--tasks", "single", "--langs", "en", "--trials", "1", "--retrievals", "exact",
                              "--passage_tokens", "40", "--json", str(json_path)]) == 0
    result = json.loads(json_path.read_text())
    assert result["config"]["passage_tokens"] == 40 and len(result["trials"]) == 1
    assert abs(result["trials"][0]["prompt_tokens"] - 300) <= 40


def test_distinct_digits_are_asked_and_recorded(trained, corpus_dir, tmp_path):
    json_path = tmp_path / "distinct.json"
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300",
                              "--tasks", "single", "multivalue", "--langs", "en", "--trials", "2", "--retrievals", "exact",
                              "--distinct_digits", "--json", str(json_path)]) == 0
    result = json.loads(json_path.read_text())
    numbers = [str(value) for trial in result["trials"] for value in trial["values"]]
    assert result["config"]["distinct_digits"] is True and len(numbers) >= 4
    assert all(len(set(number)) == len(number) for number in numbers)
    assert all(isinstance(trial["value_token"], int) for trial in result["trials"])


def test_torchrun_launch_shards_every_prompt_and_answers_as_one_process(trained, corpus_dir, tmp_path):
    """2 ranks, each holding half of every prompt's KV cache: the same greedy answers as one process,
    for exact retrieval and for HNSW graphs per shard."""
    argv = ["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "600", "--tasks", "single", "multikey",
            "--langs", "en", "zh", "--trials", "2", "--threads", "1"]
    assert eval_needles.main([*argv, "--json", str(tmp_path / "one.json")]) == 0
    launched = torchrun(2, "scripts/eval_needles.py", *argv, "--json", str(tmp_path / "two.json"))
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "sharded over 2 ranks" in launched.stdout and launched.stdout.count("model: ") == 1  # rank 0 reports
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    fields = ("task", "lang", "depth", "retrieval", "values", "answer", "correct", "prompt_tokens")
    assert [[t[f] for f in fields] for t in two["trials"]] == [[t[f] for f in fields] for t in one["trials"]]
    assert two["config"]["ranks"] == 2 and len(two["trials"]) == 16
    for row in two["rows"]:
        assert row["ranks"] == 2 and len(row["peak_rss_mb_per_rank"]) == 2 and row["peak_rss_mb"] == max(row["peak_rss_mb_per_rank"])


def test_torchrun_launch_refuses_a_dense_model(trained, corpus_dir, capsys, monkeypatch):
    original = eval_needles.load_model
    monkeypatch.setattr(eval_needles, "load_model",
                        lambda path, attn, retrieval, device, overrides=None: original(path, "dense", None, device))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300"]) == 2
    assert "a torchrun launch shards ANN attention only" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "100"], "single template"),
    (["--num_keys", "9"], "--num_keys must lie in 2..8"),
    (["--depths", "1.5"], "--depths must lie in [0, 1]"),
    (["--tasks", "pairs"], "invalid choice"),
    (["--passage_tokens", "-1"], "--passage_tokens must be >= 0"),
], ids=["too-short", "keys", "depth", "task", "passage"])
def test_eval_needles_bad_arguments_exit_2(trained, corpus_dir, capsys, argv, message):
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_eval_needles_missing_corpus_exits_2(trained, tmp_path, capsys):
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(tmp_path)]) == 2
    assert "kjv.txt: text file not found" in capsys.readouterr().err


def test_position_losses_match_the_full_forward(trained, prose_dir):
    model, tokenizer = load_model(trained, None, None, torch.device("cpu"))
    ids = tokenizer((prose_dir / "prose_heldout_kjv.txt").read_text(), add_special_tokens=False).input_ids[:700]
    sums, counts = eval_perplexity.position_losses(model, ids, chunk=128)
    assert counts == [511, 188, 0, 0, 0]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    full = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    assert sums[0] == pytest.approx(full[:511].sum().item(), rel=1e-4)
    assert sums[1] == pytest.approx(full[511:].sum().item(), rel=1e-4)


@pytest.mark.parametrize("context, far_text_matters", [(1000, False), (100, True)], ids=["all-of-it", "last-100"])
def test_recent_context_losses_see_only_recent_text(trained, prose_dir, context, far_text_matters):
    model, tokenizer = load_model(trained, None, None, torch.device("cpu"))
    ids = tokenizer((prose_dir / "prose_heldout_kjv.txt").read_text(), add_special_tokens=False).input_ids[:700]
    full_sums, full_counts = eval_perplexity.position_losses(model, ids, chunk=128)
    sums, counts = eval_perplexity.recent_context_losses(model, ids, context, chunk=64)
    assert counts == full_counts == [511, 188, 0, 0, 0]
    if far_text_matters:  # tokens past position 164 no longer see the text's start
        assert abs(sums[1] - full_sums[1]) > 1e-4 * full_sums[1]  # 10x the tolerance of agreement below
    else:  # a context longer than the text: every token sees all of its prefix, as in one pass
        assert sums == pytest.approx(full_sums, rel=1e-5)


def test_eval_perplexity_writes_every_variant(trained, prose_dir, tmp_path, capsys):
    json_path = tmp_path / "perplexity.json"
    texts = [str(prose_dir / "prose_heldout_kjv.txt"), str(prose_dir / "prose_heldout_sanguo.txt")]
    assert eval_perplexity.main(["--load", str(trained), "--dense", str(trained), "--texts", *texts, "--max_tokens", "700",
                                 "--dense_max_tokens", "256", "--chunk", "128", "--recent_context", "128",
                                 "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    assert {row["variant"] for row in rows} == {"retrieval", "recent_context", "window_only", "dense"}
    for row in rows:
        assert set(row) == {"model", "seed", "variant", "text", "bucket", "loss", "tokens"} and row["loss"] > 0
        assert row["seed"] == 7
    cell = {(r["variant"], r["text"], r["bucket"]): r for r in rows}
    assert cell[("dense", "all", "0-512")]["tokens"] == 2 * 255 and ("dense", "all", "512-4k") not in cell
    # Nothing retrieved changes the loss once blocks lie beyond the window.
    assert cell[("retrieval", "prose_heldout_kjv", "512-4k")]["loss"] != cell[("window_only", "prose_heldout_kjv", "512-4k")]["loss"]
    assert json_path.with_suffix(".png").read_bytes()[:8] == PNG
    assert eval_perplexity.main(["--load", str(trained), "--texts", str(tmp_path / "none.txt")]) == 2
    assert "file not found" in capsys.readouterr().err



def test_eval_perplexity_scores_a_dense_model_alone(trained, prose_dir, tmp_path, capsys):
    texts = [str(prose_dir / "prose_heldout_kjv.txt")]
    both, alone = tmp_path / "both.json", tmp_path / "alone.json"
    flags = ["--dense", str(trained), "--texts", *texts, "--max_tokens", "300", "--dense_max_tokens", "256", "--chunk", "128"]
    assert eval_perplexity.main(["--load", str(trained), *flags, "--json", str(both)]) == 0
    assert eval_perplexity.main(["--load", "none", *flags, "--json", str(alone)]) == 0
    alone_rows = json.loads(alone.read_text())["rows"]
    assert {row["variant"] for row in alone_rows} == {"dense"}
    dense_rows = [row for row in json.loads(both.read_text())["rows"] if row["variant"] == "dense"]
    assert [(r["text"], r["bucket"], r["tokens"]) for r in alone_rows] == [(r["text"], r["bucket"], r["tokens"]) for r in dense_rows]
    assert [r["loss"] for r in alone_rows] == pytest.approx([r["loss"] for r in dense_rows], rel=1e-6)
    assert eval_perplexity.main(["--load", "none", "--texts", *texts]) == 2
    assert "--load none scores only the --dense model, and --dense is not given" in capsys.readouterr().err

def rewrite_seed(path, seed, parts):
    """A copy of a result file as if another seed's model had written it."""
    result = json.loads(path.read_text())
    for part in parts:
        for row in result[part]:
            row["seed"] = seed
    copy = path.with_name(f"{path.stem}_seed{seed}.json")
    copy.write_text(json.dumps(result))
    return copy


def test_collect_long_context_merges_seeds(trained, corpus_dir, prose_dir, tmp_path, capsys):
    needles, losses = tmp_path / "needles.json", tmp_path / "perplexity.json"
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "--tasks", "single",
                              "--langs", "en", "--trials", "2", "--retrievals", "exact", "--json", str(needles)]) == 0
    assert eval_perplexity.main(["--load", str(trained), "--dense", str(trained), "--max_tokens", "700",
                                 "--dense_max_tokens", "256", "--chunk", "128", "--texts",
                                 str(prose_dir / "prose_heldout_kjv.txt"), "--json", str(losses)]) == 0
    out_dir = tmp_path / "collected"
    assert collect_long_context.main(["--needles", str(needles), str(rewrite_seed(needles, 8, ["rows", "trials"])),
                                      "--perplexity", str(losses), str(rewrite_seed(losses, 8, ["rows"])),
                                      "--out_dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    collected = json.loads((out_dir / "needles.json").read_text())
    assert [row["seed"] for row in collected["rows"]] == [7, 8] and len(collected["trials"]) == 4
    # The fixture model retrieves 2 blocks, not the config default 4: its selection says so.
    assert {(row["model"], row["selection"]) for row in collected["rows"]} == {(str(trained), "bounds, top 2")}
    assert [source["path"] for source in collected["sources"]] == [str(needles), str(needles.with_name("needles_seed8.json"))]
    accuracy = collected["rows"][0]["accuracy"]
    assert f"| single | en | exact | bounds, top 2 | 300 | {accuracy:.2f} (2) | {accuracy:.2f} (2) |" in out
    loss_rows = json.loads((out_dir / "perplexity.json").read_text())["rows"]
    assert {row["seed"] for row in loss_rows} == {7, 8}
    near = next(r for r in loss_rows if (r["seed"], r["variant"], r["bucket"], r["text"]) == (7, "retrieval", "0-512", "all"))
    dense = next(r for r in loss_rows if (r["seed"], r["variant"], r["bucket"], r["text"]) == (7, "dense", "0-512", "all"))
    assert f"seed 7: 0-512 loss, retrieval {near['loss']:.4f} vs dense {dense['loss']:.4f}" in out
    for name in ("needles", "perplexity"):
        assert (out_dir / f"{name}.png").read_bytes()[:8] == PNG
    # Two runs of one cell (one seed) pool their trials in the table.
    assert collect_long_context.main(["--needles", str(needles), str(needles), "--out_dir", str(tmp_path / "pooled")]) == 0
    assert f"| single | en | exact | bounds, top 2 | 300 | {accuracy:.2f} (4) |" in capsys.readouterr().out
    # A collected file folds into a new collection as it is: its sources, rows and trials come first.
    assert collect_long_context.main(["--needles", str(out_dir / "needles.json"), str(needles), "--perplexity",
                                      str(out_dir / "perplexity.json"), "--out_dir", str(tmp_path / "folded")]) == 0
    folded = json.loads((tmp_path / "folded" / "needles.json").read_text())
    assert folded["sources"] == collected["sources"] + collected["sources"][:1]
    assert folded["rows"] == collected["rows"] + collected["rows"][:1] and len(folded["trials"]) == 6
    folded_losses = json.loads((tmp_path / "folded" / "perplexity.json").read_text())
    assert folded_losses == json.loads((out_dir / "perplexity.json").read_text())


def test_collect_long_context_labels_hnsw_over_keys_with_its_search_settings():
    """Runs of HNSW over keys with different search settings, or with a top_n other than the
    default, are separate cells; exact rows of the same run, and HNSW over bounds summaries, carry
    no search settings."""
    def run(summary, keys_per_head, top_n=4):
        config = {"attn": "ann", "load": "m", "ann_block_summary": summary, "hnsw_keys_per_head": keys_per_head,
                  "hnsw_ef_search": keys_per_head, "ann_top_n": top_n}
        rows = [{"retrieval": retrieval, "selection": f"{summary}, layers 1"} for retrieval in ("exact", "hnsw")]
        return collect_long_context.labelled({"config": config, "rows": rows, "trials": []})["rows"]

    assert [row["selection"] for row in run("keys", 32)] == [
        "keys, layers 1", "keys, layers 1; 32 keys per head, efSearch 32"]
    assert run("keys", 64)[1]["selection"] == "keys, layers 1; 64 keys per head, efSearch 64"
    assert [row["selection"] for row in run("bounds", 64)] == ["bounds, layers 1"] * 2
    # A top_n other than the config default (4) is a setting of its own.
    assert [row["selection"] for row in run("keys", 32, top_n=2)] == [
        "keys, layers 1, top 2", "keys, layers 1, top 2; 32 keys per head, efSearch 32"]


@pytest.mark.parametrize("content, message", [
    (None, "file not found"),
    ("{", "not JSON"),
    ('{"rows": []}', "expected a JSON object with config, rows"),
    ('{"config": {}, "rows": [{"model": "m", "variant": "retrieval"}]}', "row 0 has no seed"),
], ids=["missing", "not-json", "no-config", "row-without-seed"])
def test_collect_long_context_bad_input_exits_2(tmp_path, capsys, content, message):
    path = tmp_path / "perplexity.json"
    if content is not None:
        path.write_text(content)
    assert collect_long_context.main(["--perplexity", str(path), "--out_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and message in err


class Copier(torch.nn.Module):
    """A stand-in model that predicts, at every position, the token `period` - 1 back (uniform before)."""

    def __init__(self, vocab, period):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(30.0))
        self.vocab, self.period = vocab, period

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, self.vocab)
        back = self.period - 1
        logits[:, back:] = F.one_hot(ids[:, : ids.shape[1] - back], self.vocab) * self.scale
        return type("Output", (), {"logits": logits})


def test_repeated_passage_losses_tell_a_copier_from_chance():
    passages = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 6, 0, 2]]
    first, repeated = repeated_passage_losses(Copier(10, 6), passages, 40)
    assert abs(first - torch.log(torch.tensor(10.0)).item()) < 1e-5 and repeated < 1e-6
    first, repeated = repeated_passage_losses(Copier(10, 4), passages, 40)  # copies from the wrong place
    assert repeated > 5


def test_probe_repeats_writes_a_row_per_language_and_passage(trained, corpus_dir, tmp_path, capsys):
    json_path = tmp_path / "repeats.json"
    assert probe_repeats.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--passage_tokens", "8", "32",
                               "--length", "96", "--passages", "2", "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    assert [(row["lang"], row["passage_tokens"], row["copy_from"]) for row in rows] == [
        ("en", 8, "window"), ("en", 32, "far"), ("zh", 8, "window"), ("zh", 32, "far")]
    assert all(row["first_nll"] > 0 and row["repeated_nll"] > 0 for row in rows)
    assert json_path.with_suffix(".png").read_bytes()[:8] == PNG and "gain" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--passage_tokens", "1"], "every --passage_tokens >= 2"),
    (["--passage_tokens", "300", "--length", "512"], "does not hold two readings"),
], ids=["tiny-passage", "too-long"])
def test_probe_repeats_bad_arguments_exit_2(trained, corpus_dir, capsys, argv, message):
    assert probe_repeats.main(["--load", str(trained), "--data_dir", str(corpus_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_probe_selection_ranks_the_needle_block_per_layer(trained, corpus_dir, tmp_path, capsys):
    json_path = tmp_path / "selection.json"
    assert probe_selection.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300",
                                 "--trials", "2", "--prefill_chunk", "100", "--json", str(json_path)]) == 0
    result = json.loads(json_path.read_text())
    rows = result["rows"]
    assert result["config"]["summary"] == "bounds" and result["config"]["top_n"] == 2
    assert sorted((row["lang"], row["layer"]) for row in rows) == [("en", 0), ("zh", 0)]
    for row in rows:
        assert row["trials"] == 2 and 10 < row["candidates"] <= 340 // 16  # prompts of 300 +- 40 tokens
        for ranking in ("summary", "max_logit", "mass"):
            assert 1 <= row[f"{ranking}_median_rank"] <= row["candidates"]
            assert 0.0 <= row[f"{ranking}_in_top_n"] <= 1.0
    assert json_path.with_suffix(".png").read_bytes()[:8] == PNG
    # Scoring by each head's best key is what max_logit ranks by: the two rankings agree.
    # An HNSW graph that finds every key ranks as the best key does too.
    keys_path = tmp_path / "selection_keys.json"
    assert probe_selection.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "--trials", "2",
                                 "--block_summary", "keys", "--hnsw_keys", "--hnsw_m", "16", "--hnsw_ef_construction", "64", "--hnsw_ef_search", "400",
                                 "--hnsw_keys_per_head", "400", "--retrieval", "hnsw", "--json", str(keys_path)]) == 0
    for row in json.loads(keys_path.read_text())["rows"]:
        for ranking in ("summary", "hnsw_keys"):
            assert row[f"{ranking}_median_rank"] == row["max_logit_median_rank"]
            assert row[f"{ranking}_in_top_n"] == row["max_logit_in_top_n"]
        assert row["hnsw_build_seconds"] > 0


def test_probe_selection_answer_mode_probes_every_answer_token(trained, corpus_dir, tmp_path, capsys):
    """--answer: a row per (layer, answer token), labelled in answer order (the first digit first: the
    prose tokenizer joins an English answer's space to it), with the teacher-forced probability of the
    token and how often it was the most likely one."""
    json_path = tmp_path / "answer.json"
    assert probe_selection.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "--trials", "2",
                                 "--answer", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("p_correct per answer token") == 4 and "best-key rank of the copied block" in out
    result = json.loads(json_path.read_text())
    assert result["config"]["answer"] is True and json_path.with_suffix(".png").read_bytes()[:8] == PNG
    for lang in ("en", "zh"):
        labels = [row["answer_token"] for row in result["rows"] if row["lang"] == lang]
        assert labels[0] == "d1" and labels[-1] == "end" and {"d2", "d3", "d4", "d5"} <= set(labels)
    for row in result["rows"]:
        assert 0.0 <= row["p_correct"] <= 1.0 and row["argmax"] in (0.0, 0.5, 1.0) and 1 <= row["trials"] <= 2
        assert 1 <= row["max_logit_median_rank"] <= row["candidates"]


def test_probe_selection_of_multikey_prompts_ranks_the_asked_labels_number(trained, corpus_dir, tmp_path, capsys):
    """--task multikey probes eval_needles.py's multikey prompts of the same seed: the number it
    follows is the asked label's, and a bad --num_keys is refused."""
    common = ["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "--trials", "2", "--seed", "3"]
    assert probe_selection.main([*common, "--task", "multikey", "--num_keys", "3", "--answer"]) == 0
    probed = re.findall(r"^(en|zh) 300 depth [0-9.]+ (\d+): p_correct", capsys.readouterr().out, flags=re.M)
    json_path = tmp_path / "multikey.json"
    assert eval_needles.main([*common, "--tasks", "multikey", "--num_keys", "3", "--retrievals", "exact",
                              "--json", str(json_path)]) == 0
    asked = [(trial["lang"], str(trial["values"][0])) for trial in json.loads(json_path.read_text())["trials"]]
    assert len(probed) == 4 and sorted(probed) == sorted(asked)
    assert probe_selection.main([*common, "--task", "multikey", "--num_keys", "9"]) == 2
    assert "--num_keys must lie in 2..8, got 9" in capsys.readouterr().err


def test_probe_selection_of_multivalue_prompts_probes_each_number_and_its_repeat(trained, corpus_dir, tmp_path, capsys):
    """--task multivalue --answer: rows for every number of the list (n2.d1, ...) and, for a later number,
    the `prev` row: the block of the number before it and the probability of repeating its first digit."""
    json_path = tmp_path / "multivalue.json"
    common = ["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "--trials", "2", "--seed", "5"]
    assert probe_selection.main([*common, "--task", "multivalue", "--answer", "--json", str(json_path)]) == 0
    probed = re.findall(r"^(en|zh) 300 depth [0-9.]+ (\d+): p_correct", capsys.readouterr().out, flags=re.M)
    rows = json.loads(json_path.read_text())["rows"]
    for lang in ("en", "zh"):
        labels = [row["answer_token"] for row in rows if row["lang"] == lang]
        assert "n2.d1" in labels and labels.index("n2.d1") < labels.index("n2.d2")
        if "n2.prev" in labels:
            assert labels.index("n2.prev") == labels.index("n2.d1") + 1
    assert any(row["answer_token"].endswith(".prev") for row in rows)
    for row in rows:
        assert 0.0 <= row["p_correct"] <= 1.0 and 1 <= row["max_logit_median_rank"] <= row["candidates"]
    trials_path = tmp_path / "multivalue_eval.json"
    assert eval_needles.main([*common, "--tasks", "multivalue", "--retrievals", "exact", "--json", str(trials_path)]) == 0
    asked = [(trial["lang"], str(trial["values"][0])) for trial in json.loads(trials_path.read_text())["trials"]]
    assert len(probed) == 4 and sorted(probed) == sorted(asked)


def test_probe_selection_refuses_a_dense_model(trained, corpus_dir, capsys, monkeypatch):
    original = probe_selection.load_model
    monkeypatch.setattr(probe_selection, "load_model",
                        lambda path, attn, retrieval, device, overrides=None: original(path, "dense", None, device))
    assert probe_selection.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300"]) == 2
    assert "only ANN attention selects blocks" in capsys.readouterr().err


def test_selection_overrides_reach_the_evaluated_model(trained, corpus_dir, prose_dir, tmp_path, capsys):
    """--block_summary, --top_n, --retrieval_layers and the HNSW settings change the loaded model's
    selection, and the JSON says so; keys with pruned retrieval and a layer the model lacks are refused
    with the reason."""
    json_path = tmp_path / "keys.json"
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300", "--tasks", "single",
                              "--langs", "en", "--trials", "1", "--retrievals", "exact", "hnsw", "--block_summary", "keys",
                              "--top_n", "3", "--hnsw_m", "8", "--hnsw_ef_construction", "24", "--hnsw_ef_search", "20", "--hnsw_keys_per_head", "12",
                              "--retrieval_layers", "0", "--logn_length", "128", "--json", str(json_path)]) == 0
    config = json.loads(json_path.read_text())["config"]
    assert (config["ann_block_summary"], config["ann_top_n"], config["ann_retrieval_layers"]) == ("keys", 3, [0])
    assert config["ann_logn_length"] == 128
    assert [config[name] for name in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search", "hnsw_keys_per_head")] == [8, 24, 20, 12]
    result = json.loads(json_path.read_text())
    assert {(row["retrieval"], row["selection"]) for row in result["rows"] + result["trials"]} == {
        ("exact", "keys, layers 0"), ("hnsw", "keys, layers 0")}
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300",
                              "--retrievals", "pruned", "--block_summary", "keys"]) == 2
    assert "'keys' cannot be pruned" in capsys.readouterr().err
    assert eval_needles.main(["--load", str(trained), "--data_dir", str(corpus_dir), "--lengths", "300",
                              "--retrieval_layers", "0", "9"]) == 2
    assert "ann_retrieval_layers must be None or distinct layer indices" in capsys.readouterr().err
    perplexity_path = tmp_path / "perplexity_keys.json"
    assert eval_perplexity.main(["--load", str(trained), "--texts", str(prose_dir / "prose_heldout_kjv.txt"),
                                 "--max_tokens", "300", "--chunk", "128", "--block_summary", "keys",
                                 "--retrieval_layers", "0", "--json", str(perplexity_path)]) == 0
    config = json.loads(perplexity_path.read_text())["config"]
    assert (config["ann_block_summary"], config["ann_top_n"], config["ann_retrieval_layers"]) == ("keys", 2, [0])
