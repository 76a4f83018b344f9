"""Failures from outside the training loop, end to end through the trainer's command line.

- A crash in the middle of writing a checkpoint (a real subprocess that dies half way through the
  write) leaves only complete checkpoints, and --from_resume 1 then reproduces the uninterrupted run.
- Bad pretrain and SFT files stop the run with exit code 2 and one line naming the file, the line
  and the problem; --skip_bad_lines trains on the rest and the end-of-run report counts what was left out.

Most bad-input cases call the stage's main() in this process (the command line minus the ~4 s of
interpreter start-up); one case per stage runs as a real script to check the exit code and that no
traceback reaches the user. The validation rules themselves are tested in test_dataset.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_trainer import PEOPLE, SMALL_MODEL, deterministic_fields, read_metrics, run_stage, write_jsonl
from trainer import train_full_sft, train_pretrain

REPO_ROOT = Path(__file__).resolve().parent.parent
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Runs the pretrain script with torch.save cut short: save number CRASH_AT_SAVE writes half of its
# bytes into the (temporary) checkpoint file, flushes them, and the process dies on the spot.
CRASH_DURING_SAVE = """
import io, os, sys
import torch
from trainer import train_pretrain

real_save, saves = torch.save, 0

def save_then_crash(obj, f, *args, **kwargs):
    global saves
    saves += 1
    if saves < int(os.environ["CRASH_AT_SAVE"]):
        return real_save(obj, f, *args, **kwargs)
    data = io.BytesIO()
    real_save(obj, data, *args, **kwargs)
    f.write(data.getvalue()[: len(data.getvalue()) // 2])
    f.flush()
    os._exit(9)

torch.save = save_then_crash
train_pretrain.main(train_pretrain.STAGE, sys.argv[1:])
"""



@pytest.fixture(autouse=True)
def user_cache_in_tmp(tmp_path, monkeypatch):
    """Line indexes of unwritable data folders would go to ~/.cache; keep them in tmp."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))


def pretrain_records(count):
    return [{"text": f"{name} lives in {city}. {city} is the capital of {country}. {name} is {20 + i} years old."}
            for i, (name, city, country) in enumerate((PEOPLE * count)[:count])]


def sft_records(count):
    return [{"conversations": [{"role": "user", "content": f"Where does {name} live?"},
                               {"role": "assistant", "content": f"{name} lives in {city}, {country}."}]}
            for name, city, country in (PEOPLE * count)[:count]]


def write_lines(path, lines):
    """JSONL with some lines given verbatim: dicts are encoded, str/bytes are written as they are."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


# ----------------------------------------------------------------------------- crash while saving


def test_crash_while_writing_a_checkpoint_keeps_the_previous_ones_and_resumes_exactly(tmp_path):
    data = write_jsonl(tmp_path / "pretrain.jsonl", pretrain_records(48))
    flags = ["--batch_size", "8", "--epochs", "2", "--save_interval", "3", "--keep_checkpoints", "2"]
    reference_dir, crashed_dir = tmp_path / "reference", tmp_path / "crashed"
    assert run_stage(train_pretrain, reference_dir, data, *flags) == 0
    reference = read_metrics(reference_dir)
    assert len(reference) == 12

    command = [sys.executable, "-c", CRASH_DURING_SAVE, "--out_dir", str(crashed_dir), "--data_path", str(data),
               *SMALL_MODEL, "--log_interval", "1", "--accumulation_steps", "1", *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**SUBPROCESS_ENV, "CRASH_AT_SAVE": "3"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 9, result.stderr[-2000:]

    # The third save (step 9) died half way: its bytes are in a temporary file, never under a checkpoint name.
    checkpoint_dir = crashed_dir / "checkpoints"
    assert sorted(path.name for path in checkpoint_dir.glob("step_*")) == ["step_0000003.pt", "step_0000006.pt"]
    [partial] = checkpoint_dir.glob(".step_0000009.pt.tmp*")
    assert partial.stat().st_size > 0
    for path in checkpoint_dir.glob("step_*.pt"):
        payload = torch.load(path, map_location="cpu", weights_only=False)
        assert payload["state"]["step"] == int(path.stem.removeprefix("step_"))
    assert len(read_metrics(crashed_dir)) == 9

    assert run_stage(train_pretrain, crashed_dir, data, *flags, "--from_resume", "1") == 0
    assert deterministic_fields(read_metrics(crashed_dir)) == deterministic_fields(reference)
    assert sorted(path.name for path in checkpoint_dir.iterdir()) == ["step_0000009.pt", "step_0000012.pt"]


# ----------------------------------------------------------------------------- bad input files

GOOD_PRETRAIN, GOOD_SFT = pretrain_records(1)[0], sft_records(1)[0]


def conversation(*turns):
    return {"conversations": [{"role": role, "content": content} for role, content in turns]}


# (stage, lines of the file, line number reported, problem reported); None: no line number (whole file).
BAD_INPUTS = [
    ("pretrain", [GOOD_PRETRAIN, "", '{"text": "Alice lives in Paris."'], 3, "malformed JSON"),
    ("pretrain", [GOOD_PRETRAIN, {"txt": "Alice lives in Paris."}], 2, "missing field 'text'"),
    ("pretrain", [GOOD_PRETRAIN, GOOD_PRETRAIN, {"text": 42}], 3, "field 'text' must be a string, got number"),
    ("pretrain", [GOOD_PRETRAIN, {"text": "   "}], 2, "field 'text' is empty"),
    ("pretrain", [GOOD_PRETRAIN, '["Alice lives in Paris."]'], 2, "expected a JSON object, got array"),
    ("pretrain", [GOOD_PRETRAIN, b'{"text": "Caf\xe9 in Paris"}'], 2, "invalid UTF-8 (byte 0xe9"),
    ("pretrain", [], None, "file is empty"),
    ("pretrain", ["", "  ", ""], None, "file is empty (only 3 blank lines)"),
    ("sft", [GOOD_SFT, "{'conversations': []}"], 2, "malformed JSON"),
    ("sft", [GOOD_SFT, GOOD_PRETRAIN], 2, "missing field 'conversations'"),
    ("sft", [GOOD_SFT, {"conversations": "hello"}], 2, "field 'conversations' must be an array, got string"),
    ("sft", [GOOD_SFT, conversation(("user", "Hi"), ("bot", "Hello"))], 2,
     "conversations[1].role 'bot' is unknown (expected one of: system, user, assistant, tool)"),
    ("sft", [GOOD_SFT, {"conversations": [{"role": "user"}]}], 2, "conversations[0] is missing field 'content'"),
    ("sft", [GOOD_SFT, GOOD_SFT, conversation(("system", "Be brief."), ("user", "Hi"))], 3,
     "conversation has no assistant turn"),
    ("sft", [GOOD_SFT, b'{"conversations": [{"role": "user", "content": "\xff"}]}'], 2, "invalid UTF-8 (byte 0xff"),
]
STAGES = {"pretrain": train_pretrain, "sft": train_full_sft}


def expected_error(path, line_no, problem):
    return f"error: {path}{'' if line_no is None else f':{line_no}'}: {problem}"


@pytest.mark.parametrize("stage, lines, line_no, problem", BAD_INPUTS, ids=[case[3][:30] for case in BAD_INPUTS])
def test_bad_input_stops_with_file_line_and_problem(stage, lines, line_no, problem, tmp_path, capsys):
    data = write_lines(tmp_path / f"{stage}.jsonl", lines)
    out_dir = tmp_path / "out"
    assert run_stage(STAGES[stage], out_dir, data, "--batch_size", "2") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected_error(data, line_no, problem)) and "\n" not in err
    assert not (out_dir / "checkpoints").exists() and not (out_dir / "metrics.jsonl").exists()


def test_missing_data_file_is_named(tmp_path, capsys):
    missing = tmp_path / "no_such.jsonl"
    assert run_stage(train_full_sft, tmp_path / "out", missing) == 2
    assert capsys.readouterr().err.strip() == f"error: --data_path {missing}: file not found"


@pytest.mark.parametrize("script, lines, line_no, problem", [
    ("trainer/train_pretrain.py", [GOOD_PRETRAIN, "", GOOD_PRETRAIN, '{"text": 1'], 4, "malformed JSON"),
    ("trainer/train_full_sft.py", [GOOD_SFT, conversation(("user", "Hi"), ("robot", "Hello"))], 2,
     "conversations[1].role 'robot' is unknown"),
])
def test_bad_input_as_a_script_exits_2_without_traceback(script, lines, line_no, problem, tmp_path):
    data = write_lines(tmp_path / "data.jsonl", lines)
    result = subprocess.run(
        [sys.executable, script, "--data_path", str(data), "--out_dir", str(tmp_path / "out"), *SMALL_MODEL],
        cwd=REPO_ROOT, env={**SUBPROCESS_ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert expected_error(data, line_no, problem) in result.stderr and "Traceback" not in result.stderr


def dataset_report(stdout):
    [line] = [line for line in stdout.splitlines() if line.startswith("dataset report: ")]
    return json.loads(line.removeprefix("dataset report: "))


def test_skip_bad_lines_trains_on_the_rest_and_reports_what_was_left_out(tmp_path, capsys):
    lines = pretrain_records(6) + ["", '{"text": ', {"text": None}, "", b'{"text": "\xe9"}', {"content": "x"}]
    lines += [{"text": "Once upon a time " * 40}]  # far longer than max_seq_len 64: cut, and counted
    data = write_lines(tmp_path / "pretrain.jsonl", lines)
    assert run_stage(train_pretrain, tmp_path / "out", data, "--batch_size", "7", "--skip_bad_lines") == 0
    report = dataset_report(capsys.readouterr().out)
    assert report["lines"] == 13 and report["used"] == 7 and report["read"] == 7
    assert report["skipped_bad"] == 4 and report["skipped_empty"] == 2 and report["truncated"] == 1
    assert [line_no for line_no, _ in report["first_bad"]] == [8, 9, 11, 12]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]


def test_skip_bad_lines_for_sft_and_a_conversation_cut_before_its_answer(tmp_path, capsys):
    long_question = conversation(("user", "Tell me about Paris. " * 30), ("assistant", "Paris is in France."))
    lines = [*sft_records(4), conversation(("user", "Hi")), "", long_question,
             conversation(("user", "Hi"), ("narrator", "..."))]
    data = write_lines(tmp_path / "sft.jsonl", lines)
    with pytest.warns(UserWarning, match=f"{data.name}:7: no assistant tokens left"):
        assert run_stage(train_full_sft, tmp_path / "out", data, "--batch_size", "5", "--skip_bad_lines") == 0
    report = dataset_report(capsys.readouterr().out)
    assert report["used"] == 5 and report["skipped_bad"] == 2 and report["skipped_empty"] == 1
    assert report["first_bad"] == [[5, "conversation has no assistant turn"],
                                   [8, "conversations[1].role 'narrator' is unknown "
                                       "(expected one of: system, user, assistant, tool)"]]
    assert report["truncated"] == 1 and report["no_labels"] == 1
