"""The shipped tokenizer: exact round trips, special token ids, chat template, no implicit specials."""
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.train_tokenizer import save, train

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
