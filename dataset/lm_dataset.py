"""
Pretraining and SFT datasets over JSONL files (one JSON object per line, minimind format):

    pretrain: {"text": "..."}
    sft:      {"conversations": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}

SFT turns may also carry tools (a system turn's "tools"/"functions"), an assistant's "tool_calls" and
"reasoning_content", and tool results (role "tool"): dataset/chat_messages.py lists the accepted shapes
and how the chat template renders them.

Both datasets return (input_ids, labels), two LongTensors of shape [max_length]:
    input_ids  token ids, right-padded with <|endoftext|> (id 0)
    labels     same length; -100 where no loss is taken (padding, prompts). The model shifts labels
               itself (HF convention): labels[t] is the target for logits[t - 1].

The files can be gigabytes (minimind's pretrain_hq.jsonl is ~1.6 GB), so nothing reads a whole file
into memory: one streaming pass validates every line and records the byte offset of each usable line;
items are then read with seek + readline. The offsets are cached next to the data file (or under
~/.cache/minimind when that folder is read-only) so the second open is instant.

Bad data is never dropped silently. By default the first bad line raises DataFormatError
("{path}:{line}: {problem}"); with skip_bad_lines=True bad lines are left out and counted,
and dataset.report() says how many and which.
"""
import hashlib
import json
import os
import sys
import warnings
import zipfile
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.chat_messages import conversation_problem, json_type, template_messages

IGNORE_INDEX = -100
END_OF_TEXT = "<|endoftext|>"  # document end and padding (id 0)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
INDEX_VERSION = 3  # bump when the index layout or the validation rules change
MAX_REPORTED_BAD_LINES = 5
UTF8_BOM = b"\xef\xbb\xbf"
ANNOUNCE_SCAN_BYTES = 64 * 2**20  # a scan of a file this big takes a while: say so

DATASET_DIR = Path(__file__).resolve().parent
DATA_FILE_NAMES = {  # minimind2 names first, then minimind-3 names
    "pretrain": ("pretrain_hq.jsonl", "pretrain_t2t_mini.jsonl"),
    "sft": ("sft_mini_512.jsonl", "sft_t2t_mini.jsonl"),
}


class DataFormatError(ValueError):
    """A data file is unusable. str(error) is "{path}:{line_no}: {problem}" (1-based line numbers)
    or "{path}: {problem}" for problems with the whole file (missing, not a file, empty)."""

    def __init__(self, path, problem, line_no=None):
        self.path, self.problem, self.line_no = str(path), problem, line_no
        where = self.path if line_no is None else f"{self.path}:{line_no}"
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):  # DataLoader workers pickle exceptions; keep the structured fields
        return type(self), (self.path, self.problem, self.line_no)


# ----------------------------------------------------------------------------- validation

def pretrain_record_problem(record: dict):
    """None if the record is a usable pretraining document, else what is wrong with it."""
    if "text" not in record:
        return "missing field 'text'"
    text = record["text"]
    if not isinstance(text, str):
        return f"field 'text' must be a string, got {json_type(text)}"
    if not text.strip():
        return "field 'text' is empty"
    return None


def sft_record_problem(record: dict):
    """None if the record is a usable conversation with at least one assistant turn, else what is wrong with it."""
    if "conversations" not in record:
        return "missing field 'conversations'"
    turns = record["conversations"]
    if problem := conversation_problem(turns):
        return problem
    if not any(turn["role"] == "assistant" for turn in turns):
        return "conversation has no assistant turn"
    return None


RECORD_VALIDATORS = {"pretrain": pretrain_record_problem, "sft": sft_record_problem}


def line_problem(raw: bytes, record_problem):
    """None if one raw JSONL line is usable, else what is wrong with it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"invalid UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1} of the line)"
    try:
        record = json.loads(line.rstrip("\r\n"))  # so columns point into the line, not past it
    except json.JSONDecodeError as error:
        return f"malformed JSON: {error.msg} (column {error.pos + 1})"
    if not isinstance(record, dict):
        return f"expected a JSON object, got {json_type(record)}"
    return record_problem(record)


# ----------------------------------------------------------------------------- line index

@dataclass
class LineIndex:
    """Where the usable lines of a JSONL file are, and what one scan of it found.

    offsets       int64 [used]  byte offset of each usable line
    line_numbers  int64 [used]  its 1-based line number in the file (for messages)
    first_bad     [(line_no, problem), ...] the first MAX_REPORTED_BAD_LINES bad lines
    """
    offsets: np.ndarray
    line_numbers: np.ndarray
    lines: int
    skipped_bad: int
    skipped_empty: int
    first_bad: list

    def stats(self) -> dict:
        return {"lines": self.lines, "used": len(self.offsets), "skipped_bad": self.skipped_bad,
                "skipped_empty": self.skipped_empty, "first_bad": list(self.first_bad)}


def scan_jsonl(path: Path, record_problem, stop_at_first_bad: bool) -> LineIndex:
    """One streaming pass over the file: validate every non-empty line and record its byte offset."""
    if path.stat().st_size >= ANNOUNCE_SCAN_BYTES:
        print(f"indexing {path} ({path.stat().st_size / 2**30:.2f} GiB) once; later opens use the cached index",
              file=sys.stderr)
    offsets, line_numbers = array("q"), array("q")
    line_no = skipped_bad = skipped_empty = 0
    first_bad = []
    offset = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line_offset = offset
            offset += len(raw)
            if line_no == 1 and raw.startswith(UTF8_BOM):  # files saved by Windows tools
                raw, line_offset = raw[len(UTF8_BOM) :], line_offset + len(UTF8_BOM)
            if not raw.strip():
                skipped_empty += 1
            elif (problem := line_problem(raw, record_problem)) is None:
                offsets.append(line_offset)
                line_numbers.append(line_no)
            elif stop_at_first_bad:
                raise DataFormatError(path, problem, line_no)
            else:
                skipped_bad += 1
                if len(first_bad) < MAX_REPORTED_BAD_LINES:
                    first_bad.append((line_no, problem))
    return LineIndex(np.array(offsets, dtype=np.int64), np.array(line_numbers, dtype=np.int64),
                     lines=line_no, skipped_bad=skipped_bad, skipped_empty=skipped_empty, first_bad=first_bad)


def index_cache_paths(path: Path, schema: str) -> list:
    """Where a file's index may be cached: next to the data, else in the user's cache folder."""
    name = f"{path.name}.{schema}-index.npz"
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimind" / "jsonl_index"
    path_digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return [path.with_name(name), user_cache / f"{path_digest}-{name}"]


def read_cached_index(path: Path, schema: str, key: dict):
    """The cached index of the file if one matches key (file size, mtime, schema, version), else None."""
    for cache_path in index_cache_paths(path, schema):
        try:
            with np.load(cache_path) as cached:
                meta = json.loads(str(cached["meta"]))
                if meta["key"] != key:
                    continue
                return LineIndex(cached["offsets"], cached["line_numbers"], meta["lines"], meta["skipped_bad"],
                                 meta["skipped_empty"], [tuple(bad) for bad in meta["first_bad"]])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # absent, corrupt, old layout
            continue
    return None


def write_cached_index(path: Path, schema: str, key: dict, index: LineIndex) -> None:
    """Cache the index at the first writable place; if there is none the index just lives in memory."""
    meta = json.dumps({"key": key, **index.stats()})
    for cache_path in index_cache_paths(path, schema):
        # write then rename, so concurrent readers (e.g. one process per GPU) never see half a file
        partial_path = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.partial")
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            with open(partial_path, "wb") as f:
                np.savez_compressed(f, offsets=index.offsets, line_numbers=index.line_numbers, meta=np.array(meta))
            os.replace(partial_path, cache_path)
            return
        except OSError:
            partial_path.unlink(missing_ok=True)
    warnings.warn(f"could not cache the line index of {path}; it will be rebuilt on the next open")


def load_line_index(path: Path, schema: str, skip_bad_lines: bool) -> LineIndex:
    """Index of the usable lines of a JSONL file, from the cache when the file is unchanged.

    Raises DataFormatError for an unusable file, for the first bad line unless skip_bad_lines,
    and when no usable line is left.
    """
    if not path.exists():
        raise DataFormatError(path, "file not found")
    if not path.is_file():
        raise DataFormatError(path, "not a file")
    stat = path.stat()
    if stat.st_size == 0:
        raise DataFormatError(path, "file is empty")

    key = {"version": INDEX_VERSION, "schema": schema, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    index = read_cached_index(path, schema, key)
    if index is None:
        index = scan_jsonl(path, RECORD_VALIDATORS[schema], stop_at_first_bad=not skip_bad_lines)
        write_cached_index(path, schema, key, index)

    if index.first_bad and not skip_bad_lines:  # the cache came from a skip_bad_lines=True scan
        line_no, problem = index.first_bad[0]
        raise DataFormatError(path, problem, line_no)
    if len(index.offsets) == 0:
        if index.skipped_bad == 0:
            raise DataFormatError(path, f"file is empty (only {index.skipped_empty} blank lines)")
        first_line, first_problem = index.first_bad[0]
        raise DataFormatError(path, f"no usable lines: all {index.skipped_bad} non-empty lines are bad "
                                    f"(first: line {first_line}: {first_problem})")
    return index


# ----------------------------------------------------------------------------- datasets

def special_token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"tokenizer has no special token {token}")
    return token_id


class JsonlDataset(Dataset):
    """Shared part of the datasets: the line index, lazy per-process file access, padding, report()."""
    schema = None  # "pretrain" | "sft", set by subclasses

    def __init__(self, data_path, tokenizer, max_length=512, skip_bad_lines=False):
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        self.data_path = Path(data_path)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = special_token_id(tokenizer, END_OF_TEXT)
        self.index = load_line_index(self.data_path, self.schema, skip_bad_lines)
        # Counted as items are read, in this process only (DataLoader workers keep their own counts).
        self.read_mask = np.zeros(len(self), dtype=bool)
        self.truncated_mask = np.zeros(len(self), dtype=bool)
        self._file, self._file_pid = None, None

    def __len__(self):
        return len(self.index.offsets)

    def read_record(self, i: int) -> dict:
        # Each process opens its own handle: a handle inherited through fork shares the file position.
        if self._file_pid != os.getpid():
            self._file, self._file_pid = open(self.data_path, "rb"), os.getpid()
        self._file.seek(int(self.index.offsets[i]))
        return json.loads(self._file.readline())

    def __getstate__(self):  # spawn-started workers: reopen the file there
        return {**self.__dict__, "_file": None, "_file_pid": None}

    def padded(self, ids: list, labels: list, i: int, truncated: bool):
        """(input_ids, labels) LongTensors [max_length], right-padded; records i as read."""
        self.read_mask[i] = True
        self.truncated_mask[i] = truncated
        padding = self.max_length - len(ids)
        return (torch.tensor(ids + [self.pad_id] * padding, dtype=torch.long),
                torch.tensor(labels + [IGNORE_INDEX] * padding, dtype=torch.long))

    def report(self) -> dict:
        """What the scan found (lines, used, skipped_bad, skipped_empty, first_bad) and what reading found:
        read (items read so far in this process) and truncated (of those, how many did not fit max_length)."""
        return {"file": str(self.data_path), **self.index.stats(),
                "read": int(self.read_mask.sum()), "truncated": int(self.truncated_mask.sum())}


class PretrainDataset(JsonlDataset):
    """Documents for next-token prediction.

    item i -> (input_ids [max_length], labels [max_length]):
        input_ids = text tokens + <|endoftext|>, cut to max_length, then padded with <|endoftext|>
        labels    = input_ids, but -100 on the padding. The first <|endoftext|> is a label,
                    so the model learns to end documents.
    """
    schema = "pretrain"

    def __getitem__(self, i):
        text = self.read_record(i)["text"]
        # max_length text tokens are enough to tell whether the document (with its end token) fits
        ids = self.tokenizer(text, add_special_tokens=False, truncation=True,
                             max_length=self.max_length)["input_ids"]
        truncated = len(ids) >= self.max_length
        ids = (ids + [self.pad_id])[: self.max_length]
        return self.padded(ids, list(ids), i, truncated)


def assistant_answer_mask(ids: list, assistant_header: list, im_end_id: int) -> list:
    """True for the tokens of each assistant answer and its closing <|im_end|>.

    An answer starts right after the token sequence of "<|im_start|>assistant\\n" and runs to the next
    <|im_end|> (included) or, when truncation cut it, to the end of ids.
    """
    mask = [False] * len(ids)
    i = 0
    while i <= len(ids) - len(assistant_header):
        if ids[i:i + len(assistant_header)] != assistant_header:
            i += 1
            continue
        start = i + len(assistant_header)
        try:
            end = ids.index(im_end_id, start) + 1  # include the closing <|im_end|>
        except ValueError:
            end = len(ids)  # truncation cut the answer
        mask[start:end] = [True] * (end - start)
        i = end
    return mask


class SFTDataset(JsonlDataset):
    """Conversations rendered with the tokenizer's chat template; loss only on what the assistant writes.

    item i -> (input_ids [max_length], labels [max_length]):
        input_ids = tokens of the rendered conversation, cut to max_length, padded with <|endoftext|>
        labels    = -100 except on each assistant turn's tokens after its "<|im_start|>assistant\\n" header:
                    think block, content, tool calls and the closing <|im_end|> (not the header, the "\\n"
                    after <|im_end|>, or system, user and tool-result turns).
    A sample whose answers were all cut off by max_length has no label: it is counted in
    report()["no_labels"] and a warning names its line, but it is still returned.
    """
    schema = "sft"

    def __init__(self, data_path, tokenizer, max_length=512, skip_bad_lines=False):
        super().__init__(data_path, tokenizer, max_length, skip_bad_lines)
        self.assistant_header = tokenizer(f"{IM_START}assistant\n", add_special_tokens=False)["input_ids"]
        self.im_end_id = special_token_id(tokenizer, IM_END)
        self.no_labels_mask = np.zeros(len(self), dtype=bool)

    def __getitem__(self, i):
        conversation = self.read_record(i)["conversations"]
        rendered = self.tokenizer.apply_chat_template(template_messages(conversation), tokenize=False)
        # one token beyond max_length is enough to tell whether the conversation was cut
        ids = self.tokenizer(rendered, add_special_tokens=False, truncation=True,
                             max_length=self.max_length + 1)["input_ids"]
        truncated = len(ids) > self.max_length
        ids = ids[: self.max_length]
        mask = assistant_answer_mask(ids, self.assistant_header, self.im_end_id)
        labels = [token if is_answer else IGNORE_INDEX for token, is_answer in zip(ids, mask)]
        if not any(mask):
            if not self.no_labels_mask.any():
                warnings.warn(f"{self.data_path}:{self.index.line_numbers[i]}: no assistant tokens left after "
                              f"cutting to max_length={self.max_length}; this sample adds no loss "
                              f"(such samples are counted in report()['no_labels'])")
            self.no_labels_mask[i] = True
        return self.padded(ids, labels, i, truncated)

    def report(self) -> dict:
        return {**super().report(), "no_labels": int(self.no_labels_mask.sum())}


# ----------------------------------------------------------------------------- finding the data

def resolve_data_path(stage: str, data_path=None, dataset_dir=DATASET_DIR) -> Path:
    """The data file for a training stage ("pretrain" | "sft").

    An explicit data_path must exist (a typo never silently trains on other data). Without one,
    the first existing of dataset/{minimind2 name}, dataset/{minimind-3 name}, dataset/sample/{same
    names}. Raises FileNotFoundError saying how to get data when there is none.
    """
    if stage not in DATA_FILE_NAMES:
        raise ValueError(f"unknown stage {stage!r} (expected one of: {', '.join(DATA_FILE_NAMES)})")
    if data_path is not None:
        if not Path(data_path).is_file():
            raise FileNotFoundError(f"{data_path}: file not found")
        return Path(data_path)
    dataset_dir = Path(dataset_dir)
    names = DATA_FILE_NAMES[stage]
    candidates = [dataset_dir / name for name in names] + [dataset_dir / "sample" / name for name in names]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked_in = ", ".join(str(candidate) for candidate in candidates)
    raise FileNotFoundError(f"no {stage} data found (looked for {looked_in}). Make small sample data "
                            f"with `python scripts/make_sample_data.py` or download the real data "
                            f"with `python scripts/download_data.py`.")
