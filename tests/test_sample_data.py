"""The sample data generator: deterministic output, valid schemas, passkey format, preset answers present."""
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.chat import preset_prompts
from evaluation.passkey import PASSKEY_INTRO, make_passkey_training

REPO_ROOT = Path(__file__).resolve().parent.parent
FILES = ["pretrain_hq.jsonl", "sft_mini_512.jsonl", "passkey_long.jsonl"]


def generate(out_dir, seed=0, as_module=False):
    entry = ["-m", "scripts.make_sample_data"] if as_module else ["scripts/make_sample_data.py"]
    subprocess.run([sys.executable, *entry, "--out_dir", str(out_dir), "--seed", str(seed), "--scale", "0.05"],
                   cwd=REPO_ROOT, check=True, capture_output=True)
    return {name: (out_dir / name).read_bytes() for name in FILES}


def read_jsonl(data):
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("sample"))


def test_same_seed_gives_identical_bytes(sample, tmp_path):
    assert generate(tmp_path, as_module=True) == sample


def test_other_seed_differs(sample, tmp_path):
    assert generate(tmp_path, seed=1)["pretrain_hq.jsonl"] != sample["pretrain_hq.jsonl"]


def test_pretrain_schema(sample):
    records = read_jsonl(sample["pretrain_hq.jsonl"])
    assert records and all(list(r) == ["text"] and r["text"].strip() for r in records)


def test_sft_schema(sample):
    records = read_jsonl(sample["sft_mini_512.jsonl"])
    assert records
    for record in records:
        messages = record["conversations"]
        if messages[0]["role"] == "system":
            messages = messages[1:]
        assert messages and len(messages) % 2 == 0
        for index, message in enumerate(messages):
            assert message["role"] == ("user", "assistant")[index % 2]
            assert set(message) == {"role", "content"} and message["content"].strip()


def test_passkey_documents(sample):
    records = read_jsonl(sample["passkey_long.jsonl"])
    assert records
    for record in records:
        text = record["text"]
        key = re.search(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", text).group(1)
        assert text.startswith(PASSKEY_INTRO)
        assert text.endswith(f"What is the pass key? The pass key is {key}.")


def test_passkey_training_documents_ask_one_key_up_to_four_times():
    """The recipe's passkey documents: one key line, then 1-4 questions each answered with that key,
    the last one ending the document; drills ask each of their keys once, right after it."""
    question_counts = []
    for record in make_passkey_training(random.Random(0), 400, max_questions=4):
        text = record["text"]
        keys = re.findall(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", text)
        answers = re.findall(r"What is the pass key\? The pass key is (\d{5})\.", text)
        if text.startswith(PASSKEY_INTRO):
            assert len(keys) == 1 and set(answers) == set(keys)
            assert text.endswith(f"What is the pass key? The pass key is {keys[0]}.")
            question_counts.append(len(answers))
        else:
            assert 2 <= len(keys) <= 6 and answers == keys
    assert set(question_counts) == {1, 2, 3, 4}
    recipe = [record["text"] for record in make_passkey_training(random.Random(0), 100)]
    assert all(text.count("What is the pass key?") == 1 for text in recipe if text.startswith(PASSKEY_INTRO))


def test_preset_answers_are_in_sft_data(sample):
    answers = {}
    for record in read_jsonl(sample["sft_mini_512.jsonl"]):
        messages = record["conversations"]
        for question, answer in zip(messages, messages[1:]):
            if question["role"] == "user":
                answers.setdefault(question["content"], set()).add(answer["content"])
    prompts = preset_prompts()
    assert len(prompts) >= 6
    for prompt, expected in prompts:
        assert prompt in answers, prompt
        assert all(expected in answer for answer in answers[prompt]), (prompt, answers[prompt])
