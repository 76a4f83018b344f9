"""The shipped tokenizer (exact round trips, special token ids, chat template, no implicit specials) and
the prose tokenizer (one token per digit, the first holding the space before it)."""
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.train_tokenizer import (NUMBER_CONTEXTS, SPACE_DIGITS, consistent_numbers, digit_numbers, one_digit_per_token,
                                     save, train)

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "model" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.mark.parametrize("text", [
    "The capital of Zorvia is Talen.",
    "佐维亚的首都是塔伦。三加五等于八。",
    "Mixed 中英文 text: 3 + 5 = 8 , ok ?  double  spaces\n\ttab",
    "Emoji 🙂🚀 and accents café naïve",
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
])
def test_round_trip_is_exact(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_vocab_size(tokenizer):
    assert len(tokenizer) == 6400


def test_special_token_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_encode_adds_no_special_tokens(tokenizer):
    plain = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.encode("hello world") == plain
    assert tokenizer("hello world")["input_ids"] == plain
    assert not {0, 1, 2} & set(plain)


def test_special_tokens_in_text_map_to_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of Zorvia?"},
    {"role": "assistant", "content": "The capital of Zorvia is Talen."},
]


def test_chat_template_renders_each_message(tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Zorvia?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of Zorvia is Talen.<|im_end|>\n"
    )


def test_chat_template_generation_prompt(tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is the capital of Zorvia?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(rendered)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1


def test_training_script_writes_a_loadable_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The sky is blue.\n\n天空是蓝色的。\n\n" * 20, encoding="utf-8")
    save(train([corpus], vocab_size=300), tmp_path / "tok", model_max_length=512)
    trained = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (trained.pad_token_id, trained.bos_token_id, trained.eos_token_id) == (0, 1, 2)
    assert trained.decode(trained.encode("天空 is blue.")) == "天空 is blue."


# ----------------------------------------------------------------------------- the prose tokenizer

PROSE_DIR = TOKENIZER_DIR.parent / "tokenizer_prose"
NUMBERS = [48213, 4821937, 100000, 999999, 2224290]


@pytest.fixture(scope="module")
def prose_tokenizer():
    return AutoTokenizer.from_pretrained(str(PROSE_DIR))


def test_prose_tokenizer_keeps_the_special_ids_and_round_trips(prose_tokenizer):
    assert len(prose_tokenizer) == 6400
    assert (prose_tokenizer.pad_token_id, prose_tokenizer.bos_token_id, prose_tokenizer.eos_token_id) == (0, 1, 2)
    for text in ["In the beginning God created 12 heavens.", "维曰：“昔微子去周，成万古之名。”", "ROMEO:\n 4821937 是数字\n"]:
        assert prose_tokenizer.decode(prose_tokenizer.encode(text)) == text


@pytest.mark.parametrize("context", sorted(NUMBER_CONTEXTS))
def test_prose_tokenizer_spells_a_number_one_digit_per_token(prose_tokenizer, context):
    """After a space the first digit's token holds the space (--digits space_joined), elsewhere only the digit."""
    template = NUMBER_CONTEXTS[context]
    for number in NUMBERS:
        text = template.format(n=number)
        pieces = prose_tokenizer.tokenize(text)
        digits = list(str(number))
        first = " " + digits[0] if f" {number}" in text else digits[0]
        spelled = [prose_tokenizer.convert_tokens_to_string([piece]) for piece in pieces]
        at = spelled.index(first)
        assert spelled[at : at + len(digits)] == [first, *digits[1:]]
        assert one_digit_per_token(prose_tokenizer, template, number)


def test_digit_measures_tell_the_three_digit_styles_apart(tokenizer, prose_tokenizer, tmp_path):
    """consistent_numbers: the same tokens in every context; digit_numbers: one digit per token, the
    first possibly holding the space before it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The key is 12345 and 67890 again.\n\n钥匙是12345。\n\n" * 30, encoding="utf-8")
    save(train([corpus], vocab_size=320, digit_style="individual"), tmp_path / "individual", model_max_length=512)
    individual = AutoTokenizer.from_pretrained(str(tmp_path / "individual"))
    assert consistent_numbers(individual, NUMBERS) == 1.0 and digit_numbers(individual, NUMBERS) == 1.0
    assert consistent_numbers(prose_tokenizer, NUMBERS) == 0.0  # " 4" differs from "4"
    assert digit_numbers(prose_tokenizer, NUMBERS) == 1.0
    assert consistent_numbers(tokenizer, NUMBERS) < 1.0 and digit_numbers(tokenizer, NUMBERS) < 1.0  # BPE merges digits


def test_training_with_individual_digits_merges_no_digit(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The key is 12345 and 12345 again.\n\n钥匙是12345。\n\n" * 30, encoding="utf-8")
    trained = train([corpus], vocab_size=320, digit_style="individual")
    merged = [token for token in trained.get_vocab() if any(c.isdigit() for c in token) and len(token) > 1]
    assert merged == []
    plain = train([corpus], vocab_size=320).get_vocab()
    assert any(any(c.isdigit() for c in token) and len(token) > 1 for token in plain)  # without the split, digits merge


def test_space_joined_digits_put_a_space_with_the_first_digit_only(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The key is here and there.\n\n钥匙是12345。\n\n" * 30, encoding="utf-8")
    trained = train([corpus], vocab_size=320, digit_style="space_joined")
    assert trained.get_vocab_size() <= 320  # the tiny corpus leaves the vocabulary short of full
    digit_tokens = {token for token in trained.get_vocab() if any(c in "0123456789" for c in token)}
    assert digit_tokens == set("0123456789") | set(SPACE_DIGITS)
    text = "is 4821937. 是4821937。 x  12"
    ids = trained.encode(text).ids
    pieces = [trained.decode([i]) for i in ids]
    assert trained.decode(ids) == text
    first = pieces.index(" 4")
    assert pieces[first - 1].endswith("is") and pieces[first + 1:first + 7] == list("821937")  # no space token
    second = pieces.index("4", first + 7)
    assert pieces[second - 1].endswith("是") and pieces[second + 1:second + 7] == list("821937")
    assert pieces[-3:] == [" ", " 1", "2"]  # only the space right before a digit joins it
