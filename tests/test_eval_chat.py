"""scripts/eval_chat.py: loading (folder, out dir, checkpoint: evaluation/loading.py, which refuses a
checkpoint holding code), attention overrides, the three modes, streaming of multi-byte text,
context truncation (evaluation/chat.py), the one-line errors, and a torchrun launch that shards every
prompt (model/context_parallel.py) and answers as one process does.

Runs go in-process through main(argv) on a ~0.5M-parameter random model; one subprocess run checks
the script starts as a file.
"""

import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from evaluation.chat import PromptBuilder, preset_prompts
from model import MiniMindConfig, MiniMindForCausalLM
from scripts import eval_chat
from tests.torchrun_launch import torchrun
from trainer import train_pretrain

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO_ROOT / "model" / "tokenizer"
SHORT = ["--max_new_tokens", "6", "--temperature", "0"]



@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def save_random_model(folder, tokenizer, attn_impl):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, attn_impl=attn_impl)
    MiniMindForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, tokenizer):
    return save_random_model(tmp_path_factory.mktemp("dense"), tokenizer, "dense")


@pytest.fixture(scope="module")
def ann_dir(tmp_path_factory, tokenizer):
    return save_random_model(tmp_path_factory.mktemp("ann"), tokenizer, "ann")


def run(argv, capsys, monkeypatch, stdin=""):
    """main(argv) in this process -> (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = eval_chat.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def answers(output):
    """The answer lines of a run's output (the text after '🤖: ')."""
    return re.findall(r"🤖: (.*)", output)


def test_prompt_mode_answers_once_and_reports_speed(dense_dir, capsys, monkeypatch):
    code, out, err = run(["--load", dense_dir, "--prompt", "What is 3 + 5?", *SHORT], capsys, monkeypatch)
    assert code == 0, err
    assert "dense attention" in out and "👶: What is 3 + 5?" in out
    assert len(answers(out)) == 1
    assert re.search(r"\[\d+ tokens, [\d.]+ tokens/s", out)
    assert "Traceback" not in out + err


def test_preset_mode_prints_every_prompt_and_a_score(ann_dir, capsys, monkeypatch):
    code, out, err = run(["--load", ann_dir, *SHORT], capsys, monkeypatch)
    assert code == 0, err
    for prompt, _ in preset_prompts():
        assert f"👶: {prompt}" in out
    assert len(answers(out)) == len(preset_prompts())
    assert re.search(rf"^\d/{len(preset_prompts())} preset answers contain the expected text$", out, re.M)


def test_chat_mode_survives_bad_input_and_exits_on_eof(dense_dir, capsys, monkeypatch):
    long_prompt = "Zorvia is a country far away. " * 40
    lines = ["   ", "hello", long_prompt, "/set top_p 2", "/set top_k many", "/set temperature 0.5",
             "/set max_new_tokens 200", "/help", "hello again"]
    argv = ["--load", dense_dir, "--mode", "chat", "--max_context", "64", "--history_turns", "2", *SHORT]
    code, out, err = run(argv, capsys, monkeypatch, stdin="".join(line + "\n" for line in lines))
    assert code == 0, err  # EOF after the last line ends the chat cleanly
    assert "empty input, type something" in out
    assert re.search(r"note: prompt too long: kept its last \d+ of \d+ tokens", out)
    assert "error: top_p must be in (0, 1], got 2.0; top_p stays 0.85" in out
    assert "error: top_k takes an integer, got 'many'" in out
    assert "temperature = 0.5" in out
    assert "error: no room for a prompt" in out  # 200 new tokens cannot fit a 64-token context
    assert "commands: /set" in out and "temperature=0.5" in out
    assert len(answers(out)) == 3  # hello, the long prompt, hello again
    assert "note: dropped the 1 oldest exchange(s)" in out  # the long exchange no longer fits as history
    assert "Traceback" not in out + err


def test_empty_line_ends_the_chat(dense_dir, capsys, monkeypatch):
    argv = ["--load", dense_dir, "--mode", "chat", *SHORT]
    code, out, _ = run(argv, capsys, monkeypatch, stdin="hi\n\nnever answered\n")
    assert code == 0
    assert len(answers(out)) == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top_p", "2"], "top_p must be in (0, 1]"),
        (["--top_p", "0"], "top_p must be in (0, 1]"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--temperature", "nan"], "temperature must be >= 0"),
        (["--top_k", "-3"], "top_k must be a non-negative integer"),
        (["--top_k", "1.5"], "argument --top_k: invalid int value: '1.5'"),
        (["--attn", "sparse"], "argument --attn: invalid choice"),
        (["--max_new_tokens", "-1"], "max_new_tokens must be a non-negative integer"),
        (["--history_turns", "-1"], "--history_turns must be >= 0"),
        (["--max_context", "10", "--max_new_tokens", "8"], "no room for a prompt"),
        (["--max_context", "100000"], "exceeds the model's 256 positions"),
        (["--system", "be brief " * 100, "--max_context", "64"], "no room for a prompt"),
    ],
)
def test_invalid_settings_exit_2_with_one_line(dense_dir, capsys, monkeypatch, flags, message):
    code, out, err = run(["--load", dense_dir, "--prompt", "hi", *flags], capsys, monkeypatch)
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert "🤖" not in out


def test_nothing_to_load_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["--prompt", "hi"], capsys, monkeypatch)
    assert code == 2 and "no trained model found" in err
    code, _, err = run(["--load", tmp_path / "missing", "--prompt", "hi"], capsys, monkeypatch)
    assert code == 2 and "not a model folder, an out dir or a checkpoint file" in err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    code, _, err = run(["--load", tmp_path / "junk.pt", "--prompt", "hi"], capsys, monkeypatch)
    assert code == 2 and "junk.pt" in err and "Traceback" not in err


class Planted:
    """Unpickles as a call of open(path, "w"): what a crafted checkpoint could run when loaded in full."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_checkpoint_holding_code_is_refused_without_running_it(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "planted.pt"
    torch.save({"model": {}, "config": {}, "args": {}, "planted": Planted(marker)}, checkpoint)
    code, _, err = run(["--load", checkpoint, "--prompt", "hi"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1
    assert f"--load {checkpoint}: UnpicklingError" in err
    assert not marker.exists()


def test_default_falls_back_to_the_pretrain_model(dense_dir, tmp_path, capsys, monkeypatch, tokenizer):
    save_random_model(tmp_path / "out" / "pretrain" / "model", tokenizer, "dense")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["--prompt", "hi", *SHORT], capsys, monkeypatch)
    assert code == 0, err
    assert f"model: {Path('out/pretrain/model')}" in out


def test_checkpoint_out_dir_and_model_folder_give_the_same_answer(tmp_path, capsys, monkeypatch):
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"text": f"Zorvia's capital is Talen. Fact {i}."}) + "\n" for i in range(8)))
    out_dir = tmp_path / "run"
    train_pretrain.main(train_pretrain.STAGE, [
        "--out_dir", str(out_dir), "--data_path", str(data), "--hidden_size", "64", "--num_hidden_layers", "2",
        "--max_seq_len", "32", "--batch_size", "4", "--accumulation_steps", "1", "--max_steps", "1", "--attn", "dense",
    ])
    capsys.readouterr()
    (checkpoint,) = (out_dir / "checkpoints").glob("step_*.pt")
    outputs = []
    for load in (checkpoint, out_dir, out_dir / "model"):
        code, out, err = run(["--load", load, "--prompt", "Where is Talen?", *SHORT], capsys, monkeypatch)
        assert code == 0, err
        outputs.append(answers(out))
    assert f"model: {out_dir / 'model'}," in out  # an out dir means its model/ folder
    assert outputs[0] == outputs[1] == outputs[2]


def test_attention_override_on_a_dense_model(dense_dir, capsys, monkeypatch):
    # A short prompt fits inside the ANN window, where ANN attention is exactly dense attention.
    prompt = ["--load", dense_dir, "--prompt", "What is the capital of Zorvia?", *SHORT]
    code, dense_out, _ = run(prompt, capsys, monkeypatch)
    assert code == 0 and "dense attention" in dense_out
    code, ann_out, err = run([*prompt, "--attn", "ann", "--retrieval", "hnsw"], capsys, monkeypatch)
    assert code == 0, err
    assert "ann (hnsw retrieval) attention" in ann_out
    assert answers(ann_out) == answers(dense_out)


def test_streaming_prints_whole_characters_only(tokenizer):
    text = "鱻龘 ok 😀"
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode(token_ids[:end]) for end in range(len(token_ids)))  # split characters

    class Recorder(io.StringIO):
        pieces = []

        def write(self, piece):
            self.pieces.append(piece)
            return super().write(piece)

    out = Recorder()
    assert eval_chat.stream_answer(iter(token_ids + [tokenizer.eos_token_id]), tokenizer, 1, out) == text
    assert out.getvalue().startswith(text + "\n")
    assert not any("\ufffd" in piece for piece in out.pieces)


def test_prompt_builder_cuts_history_first_then_the_message_start(tokenizer):
    builder = PromptBuilder(tokenizer, raw=False, system="Be brief.", max_context=60)
    history = [("first question " * 3, "first answer"), ("second question", "second answer")]
    ids, notes = builder.build("new message", history, max_new_tokens=10)
    assert notes == ["dropped the 1 oldest exchange(s) to fit the context"]
    text = tokenizer.decode(ids)
    assert "second question" in text and "first question" not in text and "Be brief." in text
    ids, notes = builder.build("word " * 100 + "THE END", [], max_new_tokens=10)
    assert len(ids) == 50 and notes[0].startswith("prompt too long")
    assert tokenizer.decode(ids).endswith("THE END<|im_end|>\n<|im_start|>assistant\n")
    raw_ids, _ = PromptBuilder(tokenizer, True, None, 60).build("Zorvia is", [], 10)
    assert raw_ids == [tokenizer.bos_token_id] + tokenizer("Zorvia is", add_special_tokens=False).input_ids


def test_runs_as_a_file(dense_dir):
    result = subprocess.run(
        [sys.executable, "scripts/eval_chat.py", "--load", str(dense_dir), "--prompt", "hi", *SHORT],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.filterwarnings("ignore:'scripts.eval_chat' found in sys.modules")
def test_runs_as_a_module(dense_dir, capsys, monkeypatch):
    # What `python -m scripts.eval_chat` does, minus the ~4 s of imports a subprocess would repeat.
    monkeypatch.setattr(sys, "argv", ["eval_chat", "--load", str(dense_dir), "--prompt", "hi", *SHORT])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("scripts.eval_chat", run_name="__main__")
    assert exit.value.code == 0
    assert "tokens/s" in capsys.readouterr().out


def one_process(argv, stdin=""):
    return subprocess.run([sys.executable, "scripts/eval_chat.py", *map(str, argv)], cwd=REPO_ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("case", ["long_prompt_sampled", "chat"])
def test_torchrun_launch_answers_as_one_process(ann_dir, case):
    """2 ranks, each holding part of every prompt's KV cache (the chat's prompts, greedy, are one
    block or less, 13-14 tokens for "hello" and "bye": one rank holds none; the long prompt runs past
    the 64-token window into retrieved blocks): the same answers as one process, greedy and sampled
    (rank 0's draws of the same seeded generator from logits within float tolerance), and in chat
    mode the commands reach every rank."""
    argv = {
        "long_prompt_sampled": ["--load", ann_dir, "--raw", "--prompt", "Zorvia is a country far away. " * 20,
                                "--max_new_tokens", "12", "--temperature", "0.9", "--top_k", "40", "--top_p", "0.9"],
        "chat": ["--load", ann_dir, "--mode", "chat", "--history_turns", "1", *SHORT],
    }[case]
    stdin = "hello\n/set max_new_tokens 3\nhow are you?\n/clear\nbye\n" if case == "chat" else ""
    single = one_process(argv, stdin)
    assert single.returncode == 0, single.stderr
    launched = torchrun(2, "scripts/eval_chat.py", *map(str, argv), input=stdin)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "sharded over 2 ranks" in launched.stdout and launched.stdout.count("model: ") == 1  # rank 0 prints
    assert answers(launched.stdout) == answers(single.stdout) and len(answers(single.stdout)) >= 1
    if case == "chat":
        assert len(answers(single.stdout)) == 3 and "max_new_tokens = 3" in launched.stdout
        assert "[3 tokens" in launched.stdout and "history cleared" in launched.stdout


def test_torchrun_launch_refuses_a_dense_model(dense_dir, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run(["--load", dense_dir, "--prompt", "hi", *SHORT], capsys, monkeypatch)
    assert code == 2 and "a torchrun launch shards ANN attention only" in err and err.count("\n") == 1
