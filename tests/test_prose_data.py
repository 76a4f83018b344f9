"""The prose corpus (dataset/prose.py) and its data builder (scripts/make_prose_data.py): the split by
position, sentence pieces, haystack streams, and that held-out text never reaches a training file."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dataset.prose import (
    PieceStream, heldout_start, heldout_stream, prose_chunks, read_corpus, sentences, split_text,
)
from scripts import make_prose_data
from tests.prose_corpus import EN_SYLLABLES, ZH_SYLLABLES, SENTENCES_PER_FILE, name, write_corpus

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = REPO_ROOT / "model" / "tokenizer_prose"
SMALL_MIX = ["--chunk_tokens", "120", "--needle_min_tokens", "300", "--needle_max_tokens", "360"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def build(corpus_dir, out_dir, *extra):
    return make_prose_data.main(["--data_dir", str(corpus_dir), "--out_dir", str(out_dir), "--tokenizer",
                                 str(TOKENIZER), *SMALL_MIX, *extra])


@pytest.fixture(scope="module")
def built(corpus_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("prose")
    assert build(corpus_dir, out_dir) == 0
    return out_dir


@pytest.mark.parametrize("text, heldout", [
    ("one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nnine\nten\n", "ten\n"),
    ("a\n" * 7, "a\n"),
    ("x" * 50, "x" * 5),
], ids=["lines", "short-lines", "no-line-break"])
def test_split_is_by_position_at_a_line_start(text, heldout):
    train, held = split_text(text)
    assert (train + held, held) == (text, heldout) and heldout_start(text) == len(train)


@pytest.mark.parametrize("text, pieces", [
    ("In the beginning. And God said, Let there be light: and there was light.\n\nGenesis",
     ["In the beginning. ", "And God said, Let there be light: and there was light.\n\n", "Genesis"]),
    ("维曰：“昔微子去周。”遂设宴相待。霸", ["维曰：“昔微子去周。”", "遂设宴相待。", "霸"]),
    ("What? No! Yes.", ["What? ", "No! ", "Yes."]),
    ("", []),
])
def test_sentences_join_back_into_the_text(text, pieces):
    assert sentences(text) == pieces and "".join(sentences(text)) == text


def test_stream_reads_every_heldout_piece_before_training_text_and_wraps(tokenizer):
    pieces = [f"Sentence number {word}. " for word in ("one", "two", "three", "four", "five", "six")]
    stream = PieceStream(pieces, heldout=3, tokenizer=tokenizer)
    per_piece = stream.token_count(0)
    assert [stream.index(1, p) for p in range(8)] == [1, 2, 0, 3, 4, 5, 1, 2]
    span = stream.take(1, 4 * per_piece)
    assert span.indices == (1, 2, 0, 3) and span.heldout_tokens == 3 * per_piece and not span.wrapped
    assert stream.take(0, 7 * per_piece).wrapped
    assert PieceStream(pieces, heldout=0, tokenizer=tokenizer).rotate == len(pieces)


def test_prose_chunks_cover_the_stream_in_order(tokenizer):
    stream = PieceStream([f"Line {i} is here. " for i in range(50)], heldout=0, tokenizer=tokenizer)
    chunks = list(prose_chunks(stream, 40))
    assert "".join(chunk["text"] for chunk in chunks) == "".join(stream.pieces)
    assert all(chunk["tokens"] <= 40 for chunk in chunks) and len(chunks) > 1


def test_heldout_stream_starts_with_heldout_text(tokenizer, corpus_dir):
    corpus = read_corpus(corpus_dir)
    stream = heldout_stream(corpus, "en", tokenizer)
    heldout_text = "".join(stream.pieces[:stream.heldout])
    assert heldout_text == split_text(corpus["kjv"])[1] + split_text(corpus["tinyshakespeare"])[1]


def names_in(text, syllables, before, after):
    return set(re.findall(f"{before}([{''.join(set(''.join(syllables)))}]{{{4 * len(syllables[0])}}}){after}", text))


def test_no_heldout_text_reaches_a_training_file(built):
    metadata = json.loads((built / "prose_data.json").read_text())
    training = (built / "prose_train.jsonl").read_text(encoding="utf-8") + "".join(
        (built / f"prose_train_{source}.txt").read_text(encoding="utf-8") for source in metadata["split"])
    for source, before, after, syllables in (("kjv", "The ", " of", EN_SYLLABLES),
                                            ("tinyshakespeare", "The ", " of", EN_SYLLABLES),
                                            ("sanguo", "第", "号", ZH_SYLLABLES)):
        heldout = names_in((built / f"prose_heldout_{source}.txt").read_text(encoding="utf-8"), syllables, before, after)
        assert heldout and not heldout & names_in(training, syllables, before, after), source
        assert metadata["split"][source]["heldout_chars"] > 0
    # Every sentence is somewhere: the held-out and training names together are all of them.
    en_names = names_in(training + (built / "prose_heldout_kjv.txt").read_text() +
                        (built / "prose_heldout_tinyshakespeare.txt").read_text(), EN_SYLLABLES, "The ", " of")
    assert en_names == {name(i, EN_SYLLABLES) for i in range(2 * SENTENCES_PER_FILE)}


def test_the_mix_holds_prose_and_needle_documents(built):
    documents = [json.loads(line) for line in (built / "prose_train.jsonl").read_text(encoding="utf-8").splitlines()]
    kinds = {kind: [d for d in documents if d["kind"] == kind] for kind in ("prose", "needle")}
    share = len(kinds["needle"]) / len(documents)
    assert abs(share - 0.3) < 0.05
    assert {d["task"] for d in kinds["needle"]} == {"single", "multikey", "multivalue"}
    assert {d["lang"] for d in documents} == {"en", "zh"}
    assert all(d["text"].rstrip().endswith((".", "。")) for d in kinds["needle"])


def test_drills_are_a_share_of_the_needle_documents(corpus_dir, tmp_path):
    assert build(corpus_dir, tmp_path, "--drill_fraction", "0.5") == 0
    documents = [json.loads(line) for line in (tmp_path / "prose_train.jsonl").read_text(encoding="utf-8").splitlines()]
    needles = [d for d in documents if d["kind"] == "needle"]
    drills = [d for d in needles if d["drill"]]
    assert 0.3 < len(drills) / len(needles) < 0.7 and {d["task"] for d in drills} == {"multikey"}
    metadata = json.loads((tmp_path / "prose_data.json").read_text())
    assert metadata["drill_documents"] == len(drills)
    assert metadata["needle_documents_by_task"]["multikey"] == sum(d["task"] == "multikey" for d in needles) - len(drills)
    for drill in drills:  # every key asked right after it, and one of them again at the end
        questions = drill["text"].count("What is the special magic number") + drill["text"].count("是多少？特别魔法数字中")
        keys = len(re.findall(r"\d{5,7}", drill["text"])) // 2
        assert questions == keys + 1, drill["text"]


def test_repeated_haystacks_are_a_share_of_the_needle_documents(corpus_dir, built, tmp_path):
    assert build(corpus_dir, tmp_path, "--repeat_fraction", "0.5") == 0
    documents = [json.loads(line) for line in (tmp_path / "prose_train.jsonl").read_text(encoding="utf-8").splitlines()]
    needles = [d for d in documents if d["kind"] == "needle"]
    repeated = [d for d in needles if d["repeated"]]
    assert 0.3 < len(repeated) / len(needles) < 0.7
    assert json.loads((tmp_path / "prose_data.json").read_text())["repeated_haystack_documents"] == len(repeated)
    for document in repeated:  # the haystack's passage recurs through the document
        assert max(Counter(sentences(document["text"])).values()) >= 2, document["text"]
    plain = [json.loads(line) for line in (built / "prose_train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert not any(d.get("repeated") for d in plain)


def test_copy_documents_are_one_random_passage_repeated(corpus_dir, built, tmp_path):
    assert build(corpus_dir, tmp_path, "--copy_documents", "6") == 0
    documents = [json.loads(line) for line in (tmp_path / "prose_train.jsonl").read_text(encoding="utf-8").splitlines()]
    copies = [d for d in documents if d["kind"] == "copy"]
    assert len(copies) == 6 and json.loads((tmp_path / "prose_data.json").read_text())["copy_documents"] == 6
    for document in copies:
        text = document["text"]
        passage = text[: text.index("\n" if document["lang"] == "en" else "。") + 1]
        assert text == passage * (len(text) // len(passage)) and len(text) >= 2 * len(passage)
    plain = [json.loads(line) for line in (built / "prose_train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {d["kind"] for d in plain} == {"prose", "needle"}  # none unless asked for


def test_same_seed_same_bytes_other_seed_other_mix(corpus_dir, built, tmp_path):
    assert build(corpus_dir, tmp_path / "again") == 0
    assert (tmp_path / "again" / "prose_train.jsonl").read_bytes() == (built / "prose_train.jsonl").read_bytes()
    assert build(corpus_dir, tmp_path / "other", "--seed", "1") == 0
    assert (tmp_path / "other" / "prose_train.jsonl").read_bytes() != (built / "prose_train.jsonl").read_bytes()


def test_split_only_writes_just_the_texts(corpus_dir, tmp_path):
    assert make_prose_data.main(["--data_dir", str(corpus_dir), "--out_dir", str(tmp_path), "--split_only"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        f"prose_{part}_{source}.txt" for part in ("train", "heldout") for source in ("kjv", "tinyshakespeare", "sanguo"))


@pytest.mark.parametrize("flags, message", [
    (["--tasks", "single", "pairs"], "unknown task 'pairs'"),
    (["--needle_min_tokens", "40"], "is shorter than the en single template"),
    (["--needle_max_tokens", "200"], "is below --needle_min_tokens"),
    (["--needle_fraction", "1"], "--needle_fraction must lie in [0, 1)"),
    (["--drill_fraction", "1.5"], "--drill_fraction must lie in [0, 1]"),
    (["--repeat_fraction", "-0.1"], "--repeat_fraction must lie in [0, 1]"),
    (["--copy_documents", "-1"], "--copy_documents must be >= 0"),
    (["--tokenizer", "/nonexistent"], "no tokenizer.json"),
    (["--sources", "bible"], "invalid choice"),
], ids=["task", "too-short", "max-below-min", "fraction", "drills", "repeats", "copies", "tokenizer", "source"])
def test_bad_arguments_exit_2_with_one_line(corpus_dir, tmp_path, capsys, flags, message):
    assert build(corpus_dir, tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_missing_text_file_exits_2(corpus_dir, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "kjv.txt").write_text((corpus_dir / "kjv.txt").read_text())
    assert build(tmp_path / "data", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "tinyshakespeare.txt: text file not found" in err and err.count("\n") == 1

