"""The needle tasks (evaluation/needles.py): needles drawn per task, their place in the haystack, the
prompt's length in tokens, training documents, answer parsing and scoring, in English and Chinese."""

import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dataset.prose import heldout_stream, read_corpus, training_stream
from evaluation.needles import (
    DIGITS_RANGE, KEY_RANGE, NEEDLE_TEXTS, TASKS, VALUE_RANGE, Needles, answer, answered_other_key, build_prompt,
    draw_needles, fit_pieces, inserted_text, key_sentence, other_values, parse_numbers, prompt_text, question, score,
    shortest_prompt, training_documents,
)
from tests.prose_corpus import write_corpus

REPO_ROOT = Path(__file__).resolve().parent.parent
LANGS = sorted(NEEDLE_TEXTS)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO_ROOT / "model" / "tokenizer_prose")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return read_corpus(write_corpus(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def heldout_streams(tokenizer, corpus):
    return {lang: heldout_stream(corpus, lang, tokenizer) for lang in LANGS}


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("task", TASKS)
def test_needles_follow_the_task(task, lang):
    for seed in range(20):
        needles = draw_needles(random.Random(seed), task, lang, 0.3)
        labels = {label for label, _, _ in needles.sentences}
        values = [value for _, value, _ in needles.sentences]
        assert KEY_RANGE[task][0] <= len(labels) <= KEY_RANGE[task][1]
        assert VALUE_RANGE[task][0] <= len(needles.values) <= VALUE_RANGE[task][1]
        assert len(set(values)) == len(values) and needles.asked in labels
        assert all(DIGITS_RANGE[0] <= len(str(value)) <= DIGITS_RANGE[1] for value in values)
        asked_depths = [at for label, _, at in needles.ordered() if label == needles.asked]
        assert asked_depths[0] == 0.3 and all(at >= 0.3 for at in asked_depths)


@pytest.mark.parametrize("task", TASKS)
def test_distinct_digits_change_only_the_numbers(task):
    """Numbers of the same lengths with no digit twice; labels, depths and what the generator draws
    next (the haystack's start) stay those of the draw without the option."""
    for seed in range(20):
        plain_rng, distinct_rng = random.Random(seed), random.Random(seed)
        plain = draw_needles(plain_rng, task, "en", 0.4)
        distinct = draw_needles(distinct_rng, task, "en", 0.4, distinct_digits=True)
        assert plain_rng.random() == distinct_rng.random()
        assert [(label, at) for label, _, at in plain.sentences] == [(label, at) for label, _, at in distinct.sentences]
        numbers = [str(value) for _, value, _ in distinct.sentences]
        assert [len(number) for number in numbers] == [len(str(value)) for _, value, _ in plain.sentences]
        assert all(len(set(number)) == len(number) and number[0] != "0" for number in numbers)
        assert len(set(numbers)) == len(numbers)


def test_same_seed_same_needles_other_seed_other_needles():
    draws = [draw_needles(random.Random(seed), "multikey", "en", 0.5) for seed in (4, 4, 5)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


@pytest.mark.parametrize("task, lang, depth, keys, values, message", [
    ("pairs", "en", 0.5, None, None, "unknown needle task"),
    ("single", "fr", 0.5, None, None, "unknown language"),
    ("single", "en", 1.5, None, None, "depth"),
    ("multikey", "en", 0.5, 9, None, "2-8 keys"),
    ("multivalue", "zh", 0.5, None, 5, "2-4 values"),
], ids=["task", "lang", "depth", "keys", "values"])
def test_bad_needle_requests_are_refused(task, lang, depth, keys, values, message):
    with pytest.raises(ValueError, match=message):
        draw_needles(random.Random(0), task, lang, depth, num_keys=keys, num_values=values)


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_key_sentences_sit_at_their_depth_between_sentences(task, lang, depth):
    pieces = [f"Piece {chr(65 + i % 26)}{i // 26}. " if lang == "en" else f"第{i}句。" for i in range(40)]
    needles = draw_needles(random.Random(1), task, lang, depth)
    text = prompt_text(needles, pieces)
    texts = NEEDLE_TEXTS[lang]
    assert text.startswith(texts.intro) and text.endswith(question(needles))
    for label, value, at in needles.sentences:
        sentence = key_sentence(needles, label, value)
        assert text.count(sentence) == 1
        before = text[:text.index(sentence)]
        whole_pieces_before = sum(piece in before for piece in pieces)
        assert whole_pieces_before == round(at * len(pieces))
    assert all(text.count(piece.strip()) == 1 for piece in pieces)


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("task", TASKS)
def test_a_right_answer_scores_and_a_wrong_one_does_not(task, lang):
    needles = draw_needles(random.Random(2), task, lang, 0.5)
    right = answer(needles)
    assert parse_numbers(right) == list(needles.values)
    assert score(needles, right) == 1.0 and score(needles, right + " 12345 and more") == 1.0
    assert score(needles, " the river") == 0.0
    assert score(needles, str(needles.values[0] + 1)) == 0.0
    if task == "multivalue":
        assert score(needles, str(needles.values[0])) == 0.0  # one of several is not all
        assert score(needles, " " + " and ".join(map(str, reversed(needles.values)))) == 1.0


def test_a_distractors_number_is_told_apart_from_a_made_up_one():
    needles = Needles("multikey", "en", (("amber falcon", 12345, 0.7), ("quiet river", 678901, 0.2),
                                         ("pale tower", 55555, 0.9)), "amber falcon")
    assert other_values(needles) == (678901, 55555)
    assert answered_other_key(needles, " 678901.") and answered_other_key(needles, " 55555, 12345")
    assert not answered_other_key(needles, " 12345 678901") and not answered_other_key(needles, " 67890.")
    assert not answered_other_key(needles, " the river")


@pytest.mark.parametrize("text, numbers", [(" 4821937.", [4821937]), ("是4821937。", [4821937]),
                                           ("12345、67890。", [12345, 67890]), ("abc123def 45", [123, 45]), ("none", [])])
def test_parse_numbers_reads_every_integer(text, numbers):
    assert parse_numbers(text) == numbers


def test_answers_are_worded_per_language():
    en = Needles("multivalue", "en", (("amber falcon", 12345, 0.1), ("amber falcon", 678901, 0.2)), "amber falcon")
    zh = Needles("multivalue", "zh", (("金色猎鹰", 12345, 0.1), ("金色猎鹰", 678901, 0.2)), "金色猎鹰")
    assert answer(en) == " 12345, 678901." and answer(zh) == "12345、678901。"
    assert question(zh) == "特别魔法数字中，金色猎鹰都有哪些？特别魔法数字中，金色猎鹰是"


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [300, 1200])
def test_prompt_has_the_target_length_from_heldout_prose(tokenizer, heldout_streams, task, lang, length):
    stream = heldout_streams[lang]
    needles = draw_needles(random.Random(3), task, lang, 0.5)
    ids, span = build_prompt(tokenizer, stream, needles, length, start=0)
    longest_piece = max(stream.token_count(i) for i in span.indices)
    assert abs(len(ids) - length) <= longest_piece
    assert tokenizer.decode(ids) == prompt_text(needles, stream.texts(span))
    assert span.tokens == len(ids) and not span.wrapped
    heldout_pieces = sum(i < stream.heldout for i in span.indices)
    if heldout_pieces == len(span.indices):
        assert span.heldout_tokens == len(ids)
    else:  # all held-out text came first, then training text
        assert heldout_pieces == stream.heldout and 0 < span.heldout_tokens < len(ids)
        assert all(i < stream.heldout for i in span.indices[:heldout_pieces])


@pytest.mark.parametrize("lang", LANGS)
def test_a_repeated_haystack_is_one_passage_over_and_over(tokenizer, heldout_streams, lang):
    stream = heldout_streams[lang]
    needles = draw_needles(random.Random(4), "single", lang, 0.5)
    ids, span = build_prompt(tokenizer, stream, needles, 600, start=5, passage_tokens=40)
    passage = stream.take(5, 40).indices
    assert span.indices == (passage * len(span.indices))[: len(span.indices)] and len(span.indices) >= 3 * len(passage)
    assert abs(len(ids) - 600) <= max(stream.token_count(i) for i in passage)
    assert tokenizer.decode(ids) == prompt_text(needles, stream.texts(span)) and not span.wrapped


def test_too_short_a_length_is_refused(tokenizer):
    needles = draw_needles(random.Random(0), "multikey", "en", 0.5, num_keys=8)
    with pytest.raises(ValueError, match="needs at least"):
        fit_pieces(tokenizer, needles, ["Some prose. "] * 10, 50)
    least = shortest_prompt(tokenizer, "multikey", "en")
    assert least > len(tokenizer(prompt_text(needles, [])).input_ids)


@pytest.mark.parametrize("lang", LANGS)
def test_a_drill_asks_every_key_right_after_it(lang):
    pieces = [f"Piece {i}. " if lang == "en" else f"第{i}句。" for i in range(30)]
    needles = draw_needles(random.Random(2), "multikey", lang, 0.5, num_keys=4, drilled=True)
    text = prompt_text(needles, pieces)
    texts = NEEDLE_TEXTS[lang]
    for label, value, _ in needles.sentences:
        drilled = inserted_text(needles, label, value)
        sentence = key_sentence(needles, label, value)
        assert drilled == texts.joiner.join([sentence, question(needles, label)]) + texts.joiner + f"{value}{texts.answer_end}"
        assert text.count(drilled) == 1
    assert text.endswith(question(needles)) and text.count(question(needles)) == 2
    plain = Needles(needles.task, lang, needles.sentences, needles.asked)
    assert prompt_text(plain, pieces).count(question(needles)) == 1
    with pytest.raises(ValueError, match="a drill is a multikey document"):
        draw_needles(random.Random(2), "single", lang, 0.5, drilled=True)


def test_training_documents_end_with_their_answer(tokenizer, corpus):
    streams = {lang: training_stream(corpus, lang, tokenizer) for lang in LANGS}
    documents = list(training_documents(random.Random(0), streams, tokenizer, 12, list(TASKS), 300, 400))
    assert {d["task"] for d in documents} == set(TASKS) and {d["lang"] for d in documents} == set(LANGS)
    for document in documents:
        end = ". " if document["lang"] == "en" else "。"
        asked = re.search(r"(?:is|are|是)([\d, 、]+)[.。]$", document["text"])
        assert asked, document["text"][-80:]
        assert 300 - 40 <= document["tokens"] <= 400 + 40 and end.strip() in document["text"]
