"""The passkey task (evaluation/passkey.py: the prompt builder's length, key line, depth and Chinese,
the answer parser), scripts/eval_passkey.py in-process on a ~0.1M-parameter random ANN model writing
JSON and a plot, and the copying probe (evaluation/copying.py, scripts/probe_copying.py)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from evaluation import copying
from evaluation.loading import load_model
from evaluation.passkey import (
    PASSKEY_FILLER,
    PASSKEY_TEXTS,
    build_prompt,
    digits_right,
    filler_sentences,
    make_passkey,
    parse_answer,
)
from model import MiniMindConfig, MiniMindForCausalLM
from scripts import eval_passkey, probe_copying
from tests.torchrun_launch import torchrun

REPO_ROOT = Path(__file__).resolve().parent.parent
KEY = 48213


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO_ROOT / "model" / "tokenizer")


def key_depth(text, lang):
    """Where the key line sits in the filler, as a fraction of the filler's characters."""
    texts = PASSKEY_TEXTS[lang]
    key_line = texts.key_line.format(key=KEY)
    before_key, after_key = text.split(key_line)
    filler_before = len(before_key) - len(texts.intro + texts.joiner)
    filler_after = len(after_key) - len(texts.joiner + texts.question)
    return filler_before / max(filler_before + filler_after, 1), filler_before + filler_after


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_filler_sentences_rejoin_into_the_filler(lang):
    texts = PASSKEY_TEXTS[lang]
    sentences = filler_sentences(texts)
    assert len(sentences) == 5 and texts.joiner.join(sentences) == texts.filler


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("length", [200, 1000, 5000])
def test_prompt_has_the_target_length_and_one_key_line(tokenizer, lang, length):
    ids = build_prompt(tokenizer, length, 0.5, KEY, lang)
    assert abs(len(ids) - length) <= 4
    text = tokenizer.decode(ids)
    texts = PASSKEY_TEXTS[lang]
    assert text.count(texts.key_line.format(key=KEY)) == 1
    assert text.startswith(texts.intro) and text.endswith(texts.question)


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.75, 1.0])
def test_key_line_sits_at_the_requested_depth(tokenizer, lang, depth):
    text = tokenizer.decode(build_prompt(tokenizer, 1500, depth, KEY, lang))
    found, filler_chars = key_depth(text, lang)
    longest_sentence = max(len(sentence) + 1 for sentence in filler_sentences(PASSKEY_TEXTS[lang]))
    assert abs(found - depth) <= longest_sentence / filler_chars


def test_prompt_is_a_training_document_without_its_answer(tokenizer):
    """With whole fillers, the builder reproduces make_passkey's documents up to "The pass key is"."""
    for document in make_passkey(random.Random(0), 5):
        prompt, answer = document["text"].rsplit(" ", 1)
        key = int(answer.rstrip("."))
        fillers_before = prompt.split("The pass key is")[0].count(PASSKEY_FILLER)
        num_fillers = prompt.count(PASSKEY_FILLER)
        ids = build_prompt(tokenizer, len(tokenizer(prompt).input_ids), fillers_before / num_fillers, key)
        assert tokenizer.decode(ids) == prompt


def test_chinese_prompt_is_chinese(tokenizer):
    text = tokenizer.decode(build_prompt(tokenizer, 300, 0.5, KEY, "zh"))
    assert "草是绿的。" in text and f"通行密钥是{KEY}。" in text and "The grass" not in text


def test_too_short_or_bad_depth_is_refused(tokenizer):
    with pytest.raises(ValueError, match="at least"):
        build_prompt(tokenizer, 20, 0.5, KEY)
    with pytest.raises(ValueError, match="depth"):
        build_prompt(tokenizer, 500, 1.5, KEY)


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 48213. Remember", 48213),
        ("   48213", 48213),
        ("key48213abc 777", 48213),
        ("是48213。", 48213),
        (" the grass is green", None),
        ("", None),
        ("12 34", 12),
    ],
)
def test_parse_answer_takes_the_first_integer(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.parametrize("text,expected", [(" 71432.", 5), (" 41432.", 4), (" 17432", 3), (" 7143", 4),
                                           (" 714329", 5), (" yellow.", 0), (" 00000", 0)])
def test_digits_right_counts_the_key_digits_in_place(text, expected):
    assert digits_right(71432, text) == expected


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            attn_impl="ann", ann_window=32, ann_block_size=16, ann_top_n=2,
                            max_position_embeddings=256, hnsw_ef_search=48)
    folder = tmp_path_factory.mktemp("tiny_ann")
    MiniMindForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("retrieval", ["exact", "hnsw"])
def test_end_to_end_writes_json_and_png(tiny_model_dir, tmp_path, capsys, retrieval):
    json_path = tmp_path / f"passkey_{retrieval}.json"
    code = eval_passkey.main([
        "--load", str(tiny_model_dir), "--lengths", "200", "300", "--trials", "3", "--attn", "ann",
        "--retrieval", retrieval, "--prefill_chunk", "128", "--max_new_tokens", "4", "--json", str(json_path),
    ])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(json_path.read_text())
    assert result["config"]["retrieval"] == retrieval and result["config"]["depths"] == [0.0, 0.5, 1.0]
    assert (result["config"]["hnsw_m"], result["config"]["hnsw_ef_search"]) == (32, 48)
    assert [(row["length"], row["depth"]) for row in result["rows"]] == [
        (length, depth) for length in (200, 300) for depth in (0.0, 0.5, 1.0)
    ]
    for row in result["rows"]:
        assert {"length", "depth", "attn", "retrieval", "accuracy", "trials"} <= set(row)
        assert row["attn"] == "ann" and row["retrieval"] == retrieval and row["accuracy"] in (0.0, 1.0)
        assert row["accuracy"] == float(parse_answer(row["answer"]) == row["key"])
        assert f"key {row['key']} -> {row['answer']!r}" in out
        assert abs(row["prompt_tokens"] - row["length"]) <= 4
    assert result["peak_rss_mb"] > 0
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "note: 300 tokens is beyond the model's 256 positions" in out
    for length in (200, 300):
        group = [row for row in result["rows"] if row["length"] == length]
        digits = sum(digits_right(row["key"], row["answer"]) / 5 for row in group) / len(group)
        accuracy = sum(row["accuracy"] for row in group) / len(group)
        assert f"{length:>8} {accuracy:>9.2f} {digits:>7.2f} {len(group):>7}" in out
    assert "s/trial" in out


def test_same_seed_same_keys_for_dense_and_ann(tiny_model_dir, tmp_path, capsys):
    keys = []
    for attn in ("dense", "ann"):
        assert eval_passkey.main(["--load", str(tiny_model_dir), "--lengths", "150", "--depths", "0.5",
                                  "--attn", attn, "--max_new_tokens", "1", "--seed", "7"]) == 0
        keys.append([line.split(" key ")[1].split()[0] for line in capsys.readouterr().out.splitlines()
                     if " key " in line])
    assert keys[0] == keys[1] and len(keys[0]) == 1


@pytest.mark.parametrize("argv", [["--depths", "1.5"], ["--lengths", "10"], ["--trials", "0"],
                                  ["--depths", "0.5", "--trials", "2"]])
def test_bad_arguments_exit_2(tiny_model_dir, capsys, argv):
    assert eval_passkey.main(["--load", str(tiny_model_dir), *argv]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_torchrun_launch_answers_as_one_process(tiny_model_dir, tmp_path):
    """3 ranks, each holding a third of every prompt's KV cache: the same greedy answers as one process."""
    argv = ["--load", str(tiny_model_dir), "--lengths", "200", "300", "--trials", "2", "--attn", "ann",
            "--max_new_tokens", "4", "--threads", "1"]
    assert eval_passkey.main([*argv, "--json", str(tmp_path / "one.json")]) == 0
    launched = torchrun(3, "scripts/eval_passkey.py", *argv, "--json", str(tmp_path / "three.json"))
    assert launched.returncode == 0, launched.stdout + launched.stderr
    one, three = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "three"))
    fields = ("length", "depth", "key", "answer", "accuracy", "prompt_tokens")
    assert [[row[f] for f in fields] for row in three["rows"]] == [[row[f] for f in fields] for row in one["rows"]]
    assert three["config"]["ranks"] == 3 and len(three["peak_rss_mb_per_rank"]) == 3
    assert "sharded over 3 ranks" in launched.stdout


def test_runs_as_a_file():
    # The timeout only guards against a hang: torch and transformers take 10-50 s to import on a loaded 2-core machine.
    result = subprocess.run([sys.executable, "scripts/eval_passkey.py", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "--prefill_chunk" in result.stdout


@pytest.mark.parametrize("key, expected", [("71432", [False] * 4), ("22429", [True, True, False, True]),
                                           ("43936", [False, True, False, True]), ("11111", [True] * 4)])
def test_after_repeated_digit_marks_ambiguous_lookups(key, expected):
    assert copying.after_repeated_digit(key) == expected


def test_probe_copying_splits_answers_by_digit_and_distance(tiny_model_dir, capsys):
    model, tokenizer = load_model(tiny_model_dir, None, None, torch.device("cpu"))
    drill = "The pass key is 71432. Remember it. 71432 is the pass key. What is the pass key? The pass key is 71432."
    [(answer, mention)] = copying.answer_spans(drill)
    assert drill[answer:answer + 5] == drill[mention:mention + 5] == "71432" and mention == drill.index("71432 is")
    question = "What is the pass key?"
    far = next(make_passkey(random.Random(0), 1))["text"].replace(question, "Filler. " * 40 + question)
    [(beyond_drill, first, later, key)] = copying.digit_losses(model, tokenizer, drill, window=32)
    [(beyond_far, _, _, _)] = copying.digit_losses(model, tokenizer, far, window=32)
    assert (beyond_drill, beyond_far, key) == (False, True, "71432")
    assert len(later) == 4 and all(loss > 0 for loss in [first, *later])
    assert probe_copying.main(["--load", str(tiny_model_dir), "--docs", "12"]) == 0
    out = capsys.readouterr().out
    window = model.config.ann_window
    assert f"<= {window} back" in out and f"> {window} back" in out and "chance 2.30" in out and "after repeated" in out
    assert probe_copying.main(["--load", str(tiny_model_dir), "--docs", "12", "--split", "200"]) == 0
    assert "<= 200 back" in capsys.readouterr().out
    # A longer split moves answers from far to near; none is lost.
    by_window, by_200 = (copying.probe(model, tokenizer, 12, 0, split) for split in (None, 200))
    answers = {table_name: {beyond: table[(beyond, "first")][1] for beyond in (False, True) if (beyond, "first") in table}
               for table_name, table in (("window", by_window), ("200", by_200))}
    assert sum(answers["window"].values()) == sum(answers["200"].values())
    assert answers["200"][False] > answers["window"][False]
    # Later digits split by the digit before them: every later digit lands in exactly one half.
    for beyond in (False, True):
        if (beyond, "later") in by_window:
            halves = [by_window.get((beyond, part), (0.0, 0)) for part in ("after unique", "after repeated")]
            assert sum(count for _, count in halves) == by_window[(beyond, "later")][1]
            assert sum(mean * count for mean, count in halves) == pytest.approx(
                by_window[(beyond, "later")][0] * by_window[(beyond, "later")][1])
    assert probe_copying.main(["--load", str(tiny_model_dir), "--docs", "0"]) == 2
    assert probe_copying.main(["--load", str(tiny_model_dir), "--split", "-1"]) == 2
