"""PretrainDataset / SFTDataset: exact labels, validation messages, skipping, the index cache, data paths."""
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from dataset import lm_dataset
from dataset.lm_dataset import (DataFormatError, PretrainDataset, SFTDataset, index_cache_paths,
                                resolve_data_path)

REPO = Path(__file__).resolve().parent.parent
IGNORE = -100
PAD = 0  # <|endoftext|>
IM_END = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(REPO / "model" / "tokenizer"))


@pytest.fixture(autouse=True)
def user_cache_in_tmp(tmp_path, monkeypatch):
    """Keep the fallback index cache away from the real ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))


def write_lines(path: Path, lines) -> Path:
    """Write JSONL lines: dicts are JSON-encoded, str/bytes are written verbatim."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line, ensure_ascii=False)
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected_sft(tokenizer, conversation):
    """(ids, labels) built turn by turn: header, content, <|im_end|>, "\\n"; labels on answers + <|im_end|>."""
    ids, labels = [], []
    for turn in conversation:
        header = encode(tokenizer, f"<|im_start|>{turn['role']}\n")
        content = encode(tokenizer, turn["content"])
        newline = encode(tokenizer, "\n")
        is_answer = turn["role"] == "assistant"
        ids += header + content + [IM_END] + newline
        labels += [IGNORE] * len(header) + (content + [IM_END] if is_answer else [IGNORE] * (len(content) + 1))
        labels += [IGNORE] * len(newline)
    return ids, labels


def padded(values, length, fill):
    return values + [fill] * (length - len(values))


def conversation(*turns):
    return {"conversations": [{"role": role, "content": content} for role, content in turns]}


SINGLE_TURN = conversation(("user", "What is the capital of Zorvia?"), ("assistant", "The capital of Zorvia is Talen."))
WITH_SYSTEM = conversation(("system", "You are a helpful assistant."), ("user", "Hi there"),
                           ("assistant", "Hello! How can I help?"))
MULTI_TURN = conversation(("user", "1 + 2 = ?"), ("assistant", "3"), ("user", "佐维亚的首都是哪里？"),
                          ("assistant", "佐维亚的首都是塔伦。"), ("user", "Thanks"), ("assistant", "You're welcome."))


# ----------------------------------------------------------------------------- SFT labels

@pytest.mark.parametrize("record", [SINGLE_TURN, WITH_SYSTEM, MULTI_TURN], ids=["single", "system", "multi"])
def test_sft_labels_are_exactly_the_answers_and_their_im_end(tmp_path, tokenizer, record):
    data = SFTDataset(write_lines(tmp_path / "sft.jsonl", [record]), tokenizer, max_length=128)
    input_ids, labels = data[0]
    ids, expected_labels = expected_sft(tokenizer, record["conversations"])
    assert input_ids.dtype == labels.dtype == torch.long
    assert input_ids.shape == labels.shape == (128,)
    assert input_ids.tolist() == padded(ids, 128, PAD)
    assert labels.tolist() == padded(expected_labels, 128, IGNORE)
    answers = [turn["content"] + "<|im_end|>" for turn in record["conversations"] if turn["role"] == "assistant"]
    assert tokenizer.decode([t for t in labels.tolist() if t != IGNORE]) == "".join(answers)
    assert data.report()["truncated"] == 0 and data.report()["no_labels"] == 0


def test_sft_truncation_inside_an_answer_keeps_the_remaining_answer_tokens(tmp_path, tokenizer):
    ids, expected_labels = expected_sft(tokenizer, MULTI_TURN["conversations"])
    answer_positions = [i for i, label in enumerate(expected_labels) if label != IGNORE]
    last_answer_start = answer_positions[-len(encode(tokenizer, "You're welcome.")) - 1]
    max_length = last_answer_start + 2  # two tokens into the last answer
    data = SFTDataset(write_lines(tmp_path / "sft.jsonl", [MULTI_TURN]), tokenizer, max_length=max_length)
    input_ids, labels = data[0]
    assert input_ids.tolist() == ids[:max_length]
    assert labels.tolist() == expected_labels[:max_length]
    assert labels[-2:].tolist() == ids[last_answer_start:last_answer_start + 2]
    assert data.report()["truncated"] == 1


def test_sft_sample_without_labels_after_truncation_is_counted_not_fatal(tmp_path, tokenizer):
    long_question = conversation(("user", "word " * 100), ("assistant", "ok"))
    path = write_lines(tmp_path / "sft.jsonl", [SINGLE_TURN, long_question])
    data = SFTDataset(path, tokenizer, max_length=32)
    with pytest.warns(UserWarning, match=r"sft\.jsonl:2: no assistant tokens left"):
        input_ids, labels = data[1]
    assert (labels == IGNORE).all() and input_ids.shape == (32,)
    data[0]  # fits: neither truncated nor without labels
    assert data.report()["no_labels"] == 1
    assert data.report()["truncated"] == 1


# ----------------------------------------------------------------------------- pretrain items

def test_pretrain_item_ends_with_a_labelled_endoftext_then_ignored_padding(tmp_path, tokenizer):
    text = "The capital of Zorvia is Talen."
    data = PretrainDataset(write_lines(tmp_path / "pre.jsonl", [{"text": text}]), tokenizer, max_length=32)
    input_ids, labels = data[0]
    tokens = encode(tokenizer, text) + [PAD]
    assert input_ids.shape == labels.shape == (32,)
    assert input_ids.tolist() == padded(tokens, 32, PAD)
    assert labels.tolist() == padded(tokens, 32, IGNORE)
    assert labels[len(tokens) - 1] == PAD  # the document end is learned
    assert data.report()["truncated"] == 0


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [b"", lm_dataset.UTF8_BOM], ids=["no_bom", "bom"])
@pytest.mark.parametrize("schema", ["pretrain", "sft"])
def test_windows_saved_file_reads_like_a_plain_one(tmp_path, tokenizer, schema, bom, line_end):
    """A UTF-8 BOM before the first line and CRLF line ends (Windows tools) change nothing read."""
    records = [{"text": "The capital of Zorvia is Talen."}, {"text": "佐维亚的首都是塔伦。"}]
    if schema == "sft":
        records = [SINGLE_TURN, MULTI_TURN]
    dataset_class = PretrainDataset if schema == "pretrain" else SFTDataset
    plain = write_lines(tmp_path / "plain.jsonl", records)
    saved = tmp_path / "saved.jsonl"
    saved.write_bytes(bom + b"".join(json.dumps(r, ensure_ascii=False).encode() + line_end for r in records))
    expected, got = dataset_class(plain, tokenizer, max_length=64), dataset_class(saved, tokenizer, max_length=64)
    assert len(got) == len(expected) == 2
    for i in range(2):
        for want, have in zip(expected[i], got[i]):
            assert torch.equal(want, have)


def test_pretrain_long_document_is_cut_and_counted(tmp_path, tokenizer):
    text = "one two three four five six seven eight nine ten " * 5
    data = PretrainDataset(write_lines(tmp_path / "pre.jsonl", [{"text": text}]), tokenizer, max_length=16)
    input_ids, labels = data[0]
    assert input_ids.tolist() == encode(tokenizer, text)[:16] == labels.tolist()
    assert data.report()["truncated"] == 1


def test_document_that_fills_max_length_exactly_loses_its_end_and_counts_as_truncated(tmp_path, tokenizer):
    text = "The capital of Zorvia is Talen."
    length = len(encode(tokenizer, text))
    data = PretrainDataset(write_lines(tmp_path / "pre.jsonl", [{"text": text}]), tokenizer, max_length=length)
    assert PAD not in data[0][0].tolist()
    assert data.report()["truncated"] == 1


# ----------------------------------------------------------------------------- validation

GOOD = {"pretrain": {"text": "fine"}, "sft": SINGLE_TURN}
BAD_LINES = [
    ("pretrain", b'{"text": "a"', "malformed JSON: Expecting ',' delimiter (column 13)"),
    ("pretrain", b'["text"]', "expected a JSON object, got array"),
    ("pretrain", b'{"content": "a"}', "missing field 'text'"),
    ("pretrain", b'{"text": 5}', "field 'text' must be a string, got number"),
    ("pretrain", b'{"text": "   "}', "field 'text' is empty"),
    ("pretrain", b'{"text": "caf\xe9"}', "invalid UTF-8 (byte 0xe9 at byte 14 of the line)"),
    ("sft", b'{"text": "a"}', "missing field 'conversations'"),
    ("sft", b'{"conversations": {"role": "user"}}', "field 'conversations' must be an array, got object"),
    ("sft", b'{"conversations": []}', "field 'conversations' is an empty array"),
    ("sft", b'{"conversations": ["hi"]}', "conversations[0] must be an object, got string"),
    ("sft", b'{"conversations": [{"content": "hi"}]}', "conversations[0] is missing field 'role'"),
    ("sft", b'{"conversations": [{"role": "user"}]}', "conversations[0] is missing field 'content'"),
    ("sft", b'{"conversations": [{"role": 1, "content": "hi"}]}', "conversations[0].role must be a string, got number"),
    ("sft", b'{"conversations": [{"role": "user", "content": null}]}',
     "conversations[0].content must be a string, got null"),
    ("sft", b'{"conversations": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}',
     "conversations[1].role 'bot' is unknown (expected one of: system, user, assistant, tool)"),
    ("sft", b'{"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}',
     "conversation has no assistant turn"),
]
DATASETS = {"pretrain": PretrainDataset, "sft": SFTDataset}


@pytest.mark.parametrize("schema, bad_line, problem", BAD_LINES)
def test_bad_line_raises_with_file_line_and_problem(tmp_path, tokenizer, schema, bad_line, problem):
    # a blank line before the bad one: line numbers count every line of the file
    path = write_lines(tmp_path / f"{schema}.jsonl", [GOOD[schema], "", bad_line, GOOD[schema]])
    with pytest.raises(DataFormatError) as error:
        DATASETS[schema](path, tokenizer)
    assert str(error.value) == f"{path}:3: {problem}"
    assert (error.value.path, error.value.line_no, error.value.problem) == (str(path), 3, problem)


@pytest.mark.parametrize("make_file, problem", [
    (lambda path: None, "file not found"),
    (lambda path: path.mkdir(), "not a file"),
    (lambda path: path.write_bytes(b""), "file is empty"),
    (lambda path: path.write_bytes(b"\n  \n\n"), "file is empty (only 3 blank lines)"),
])
def test_unusable_file_raises_with_path_and_problem(tmp_path, tokenizer, make_file, problem):
    path = tmp_path / "data.jsonl"
    make_file(path)
    with pytest.raises(DataFormatError) as error:
        PretrainDataset(path, tokenizer)
    assert str(error.value) == f"{path}: {problem}"


def test_skip_bad_lines_counts_and_reports_every_kind_of_skip(tmp_path, tokenizer):
    lines = [GOOD["sft"], "", b"not json", GOOD["sft"], "   ", b'{"conversations": []}', GOOD["sft"]]
    data = SFTDataset(write_lines(tmp_path / "sft.jsonl", lines), tokenizer, skip_bad_lines=True)
    assert len(data) == 3
    report = data.report()
    assert {key: report[key] for key in ("lines", "used", "skipped_bad", "skipped_empty")} == \
        {"lines": 7, "used": 3, "skipped_bad": 2, "skipped_empty": 2}
    assert report["first_bad"] == [(3, "malformed JSON: Expecting value (column 1)"),
                                   (6, "field 'conversations' is an empty array")]
    assert data.index.line_numbers.tolist() == [1, 4, 7]
    assert all(data[i][0].shape == (512,) for i in range(3))


def test_skip_bad_lines_reports_at_most_five_bad_lines_but_counts_all(tmp_path, tokenizer):
    path = write_lines(tmp_path / "pre.jsonl", [b"{"] * 8 + [GOOD["pretrain"]])
    report = PretrainDataset(path, tokenizer, skip_bad_lines=True).report()
    assert report["skipped_bad"] == 8 and report["used"] == 1
    assert [line for line, _ in report["first_bad"]] == [1, 2, 3, 4, 5]


def test_file_with_only_bad_lines_is_an_error_even_when_skipping(tmp_path, tokenizer):
    path = write_lines(tmp_path / "pre.jsonl", [b"[1]", b"{"])
    with pytest.raises(DataFormatError, match=r"no usable lines: all 2 non-empty lines are bad \(first: line 1: "):
        PretrainDataset(path, tokenizer, skip_bad_lines=True)


def test_data_format_error_survives_pickling():
    error = pickle.loads(pickle.dumps(DataFormatError("a.jsonl", "missing field 'text'", 7)))
    assert (str(error), error.line_no) == ("a.jsonl:7: missing field 'text'", 7)


# ----------------------------------------------------------------------------- index cache

@pytest.fixture
def scan_counter(monkeypatch):
    calls = []
    real_scan = lm_dataset.scan_jsonl

    def counting_scan(*args, **kwargs):
        calls.append(args[0])
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(lm_dataset, "scan_jsonl", counting_scan)
    return calls


def test_second_open_uses_the_cached_index(tmp_path, tokenizer, scan_counter):
    path = write_lines(tmp_path / "pre.jsonl", [{"text": f"document {i}"} for i in range(20)])
    first = PretrainDataset(path, tokenizer, max_length=16)
    second = PretrainDataset(path, tokenizer, max_length=16)
    assert len(scan_counter) == 1
    assert (tmp_path / "pre.jsonl.pretrain-index.npz").is_file()
    assert second.index.offsets.tolist() == first.index.offsets.tolist()
    assert second.report() == first.report()
    assert all(torch.equal(first[i][0], second[i][0]) for i in range(20))


def test_changed_file_or_other_schema_is_rescanned(tmp_path, tokenizer, scan_counter):
    path = write_lines(tmp_path / "data.jsonl", [{"text": "a"}, SINGLE_TURN])
    PretrainDataset(path, tokenizer, skip_bad_lines=True)
    SFTDataset(path, tokenizer, skip_bad_lines=True)  # same file, other schema: its own index
    assert len(scan_counter) == 2
    write_lines(path, [{"text": "a"}, {"text": "b"}, SINGLE_TURN])
    assert len(PretrainDataset(path, tokenizer, skip_bad_lines=True)) == 2
    assert len(scan_counter) == 3


def test_corrupt_cache_is_rebuilt(tmp_path, tokenizer, scan_counter):
    path = write_lines(tmp_path / "pre.jsonl", [{"text": "a"}, {"text": "b"}])
    index_cache_paths(path, "pretrain")[0].write_bytes(b"not an npz file")
    assert len(PretrainDataset(path, tokenizer)) == 2
    assert len(PretrainDataset(path, tokenizer)) == 2
    assert len(scan_counter) == 1


def test_cached_bad_lines_still_raise_without_skip_bad_lines(tmp_path, tokenizer, scan_counter):
    path = write_lines(tmp_path / "pre.jsonl", [{"text": "a"}, b"{"])
    PretrainDataset(path, tokenizer, skip_bad_lines=True)
    with pytest.raises(DataFormatError, match=r"pre\.jsonl:2: malformed JSON"):
        PretrainDataset(path, tokenizer)
    assert len(scan_counter) == 1


def test_index_goes_to_the_user_cache_when_the_data_folder_is_not_writable(tmp_path, tokenizer, scan_counter):
    path = write_lines(tmp_path / "pre.jsonl", [{"text": "a"}])
    next_to_data, in_user_cache = index_cache_paths(path, "pretrain")
    next_to_data.mkdir()  # occupy the name so writing the cache there fails
    PretrainDataset(path, tokenizer)
    PretrainDataset(path, tokenizer)
    assert in_user_cache.is_file() and str(in_user_cache).startswith(str(tmp_path / "user_cache"))
    assert len(scan_counter) == 1


def test_forked_dataloader_workers_read_the_same_items(tmp_path, tokenizer):
    path = write_lines(tmp_path / "pre.jsonl", [{"text": f"document number {i}"} for i in range(8)])
    data = PretrainDataset(path, tokenizer, max_length=16)
    data[0]  # the parent opens the file before the workers fork
    direct = torch.stack([data[i][0] for i in range(8)])
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork")
    assert torch.equal(torch.cat([input_ids for input_ids, _ in loader]), direct)
    assert torch.equal(pickle.loads(pickle.dumps(data))[3][0], direct[3])


# ----------------------------------------------------------------------------- resolve_data_path

def test_resolve_data_path_search_order(tmp_path):
    (tmp_path / "sample").mkdir()
    order = [tmp_path / "pretrain_hq.jsonl", tmp_path / "pretrain_t2t_mini.jsonl",
             tmp_path / "sample" / "pretrain_hq.jsonl", tmp_path / "sample" / "pretrain_t2t_mini.jsonl"]
    for path in order:
        path.write_text("{}\n")
    for path in order:
        assert resolve_data_path("pretrain", dataset_dir=tmp_path) == path
        path.unlink()
    (tmp_path / "sample" / "sft_t2t_mini.jsonl").write_text("{}\n")
    assert resolve_data_path("sft", dataset_dir=tmp_path) == tmp_path / "sample" / "sft_t2t_mini.jsonl"

    explicit = tmp_path / "mine.jsonl"
    explicit.write_text("{}\n")
    assert resolve_data_path("sft", explicit, dataset_dir=tmp_path) == explicit
    with pytest.raises(FileNotFoundError, match=r"typo\.jsonl: file not found"):
        resolve_data_path("sft", tmp_path / "typo.jsonl", dataset_dir=tmp_path)


def test_resolve_data_path_without_data_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        resolve_data_path("pretrain", dataset_dir=tmp_path)
    message = str(error.value)
    assert "python scripts/make_sample_data.py" in message and "python scripts/download_data.py" in message
    assert str(tmp_path / "sample" / "pretrain_hq.jsonl") in message
    with pytest.raises(ValueError, match="unknown stage 'dpo'"):
        resolve_data_path("dpo", dataset_dir=tmp_path)
