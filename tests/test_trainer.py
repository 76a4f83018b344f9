"""The shared training loop (trainer/loop.py) through its two stage scripts.

Runs go in-process where possible (a subprocess pays ~4 s of imports); the kill test and one
as-a-file check need real subprocesses. All runs use a ~0.5M-parameter model on tiny JSONL files,
single-threaded, so in-process and subprocess runs compute bitwise the same numbers.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model import MiniMindConfig, MiniMindForCausalLM
from trainer import train_full_sft, train_pretrain
from trainer.optim import build_optimizer, learning_rate_at, set_learning_rates

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL_MODEL = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64"]
PEOPLE = [("Alice", "Paris", "France"), ("Bruno", "Rome", "Italy"), ("Chen", "Beijing", "China"),
          ("Dana", "Madrid", "Spain"), ("Emil", "Berlin", "Germany"), ("Fumi", "Tokyo", "Japan")]



def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    texts = [
        f"{name} lives in {city}. {city} is the capital of {country}. {name} is {20 + 3 * i + j} years old."
        for j in range(8)
        for i, (name, city, country) in enumerate(PEOPLE)
    ]
    write_jsonl(folder / "pretrain.jsonl", [{"text": text} for text in texts])
    chats = [
        {"conversations": [{"role": "user", "content": f"Where does {name} live?"},
                           {"role": "assistant", "content": f"{name} lives in {city}, the capital of {country}."}]}
        for name, city, country in PEOPLE * 4
    ]
    write_jsonl(folder / "sft.jsonl", chats)
    return folder


def run_stage(script, out_dir, data_path, *extra):
    """Run a stage in this process; returns its exit code (0 when main returns)."""
    argv = ["--out_dir", str(out_dir), "--data_path", str(data_path), *SMALL_MODEL, "--log_interval", "1"]
    argv += ["--accumulation_steps", "1", *extra]  # later flags win
    try:
        script.main(script.STAGE, argv)
    except SystemExit as exit:
        return exit.code
    return 0


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def deterministic_fields(records):
    return [{key: r[key] for key in ("step", "epoch", "loss", "lr", "tokens_seen")} for r in records]


@pytest.fixture(scope="module")
def pretrained(data_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("pretrain")
    code = run_stage(
        train_pretrain, out_dir, data_dir / "pretrain.jsonl",
        "--batch_size", "8", "--learning_rate", "2e-3", "--epochs", "8", "--save_interval", "20",
    )
    assert code == 0
    return out_dir


def test_short_pretrain_run_lowers_loss_and_writes_outputs(pretrained, capsys):
    records = read_metrics(pretrained)
    assert [r["step"] for r in records] == list(range(1, 49))  # 48 samples / 8 = 6 steps x 8 epochs
    assert records[-1]["loss"] < records[0]["loss"] - 2.0
    assert records[-1]["tokens_seen"] > records[0]["tokens_seen"] > 0
    assert (pretrained / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (pretrained / "checkpoints").glob("*.pt")) == ["step_0000040.pt", "step_0000048.pt"]
    model = MiniMindForCausalLM.from_pretrained(pretrained / "model")
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert (pretrained / "model" / "tokenizer.json").exists()


def test_sft_starts_from_pretrained_weights(pretrained, data_dir, tmp_path):
    common = ("--batch_size", "8", "--epochs", "1", "--learning_rate", "1e-3")
    assert run_stage(train_full_sft, tmp_path / "fresh", data_dir / "sft.jsonl", *common) == 0
    assert run_stage(train_full_sft, tmp_path / "sft", data_dir / "sft.jsonl", "--from_weight",
                     str(pretrained / "model"), *common) == 0
    fresh, tuned = read_metrics(tmp_path / "fresh"), read_metrics(tmp_path / "sft")
    assert [r["step"] for r in tuned] == [1, 2, 3]
    # A model that has already read these names and cities predicts the answers far better than random init.
    assert tuned[0]["loss"] < fresh[0]["loss"] - 2.0
    assert MiniMindForCausalLM.from_pretrained(tmp_path / "sft" / "model").config.hidden_size == 64


def shift_weights(state_dict):
    """{name: tensor} of the token-shift weights --wide_shift_from_step holds (k_shift_wide, q_shift)."""
    return {name: value for name, value in state_dict.items() if name.endswith(("k_shift_wide", "q_shift"))}


def test_held_back_wide_shift_trains_as_key_shift_1_until_its_step(data_dir, tmp_path):
    # 48 samples / 8 -> 6 steps per epoch, 12 in all; the wide shift is held for the first 4 updates.
    data = data_dir / "pretrain.jsonl"
    common = ["--batch_size", "8", "--epochs", "2", "--learning_rate", "2e-3", "--save_interval", "4",
              "--keep_checkpoints", "3"]
    assert run_stage(train_pretrain, tmp_path / "narrow", data, *common, "--key_shift", "1") == 0
    assert run_stage(train_pretrain, tmp_path / "held", data, *common, "--key_shift", "2", "--query_shift", "1",
                     "--wide_shift_from_step", "4", "--hnsw_ef_search", "128", "--hnsw_m", "12",
                     "--hnsw_ef_construction", "48", "--hnsw_keys_per_head", "24") == 0
    narrow, held = ([r["loss"] for r in read_metrics(tmp_path / name)] for name in ("narrow", "held"))
    # Step k's loss is taken before update k: the first five come from weights of held updates only.
    # Two different models compute them, which may round differently.
    assert held[:5] == pytest.approx(narrow[:5], rel=1e-6, abs=0)

    def held_rows(step):
        path = tmp_path / "held" / "checkpoints" / f"step_{step:07d}.pt"
        return shift_weights(torch.load(path, weights_only=False)["model"])

    assert len(held_rows(4)) == 4 and not any(rows.any() for rows in held_rows(4).values())  # never updated
    assert all(rows.any() for rows in held_rows(8).values())
    saved = MiniMindForCausalLM.from_pretrained(tmp_path / "held" / "model").config
    assert (saved.key_shift, saved.query_shift, saved.hnsw_ef_search) == (2, 1, 128)
    assert (saved.hnsw_m, saved.hnsw_ef_construction, saved.hnsw_keys_per_head) == (12, 48, 24)
    # Continuing from weights whose wide rows are trained, the hold keeps them as they are (no decay).
    assert run_stage(train_pretrain, tmp_path / "continued", data, *common, "--from_weight", str(tmp_path / "held" / "model"),
                     "--wide_shift_from_step", "100", "--ann_retrieval_layers", "1", "--ann_logn_length", "64",
                     "--ann_batch_distractors", "--ann_distractor_blocks", "2") == 0
    continued = MiniMindForCausalLM.from_pretrained(tmp_path / "continued" / "model").config
    assert (continued.ann_retrieval_layers, continued.ann_logn_length, continued.ann_batch_distractors) == ([1], 64, True)
    assert continued.ann_distractor_blocks == 2
    assert not MiniMindForCausalLM.from_pretrained(tmp_path / "held" / "model").config.ann_batch_distractors
    before, after = (MiniMindForCausalLM.from_pretrained(tmp_path / name / "model").state_dict()
                     for name in ("held", "continued"))
    for name, rows in shift_weights(before).items():
        assert rows.any() and torch.equal(after[name], rows)
    for name in (name for name in before if name.endswith("k_shift")):
        assert not torch.equal(after[name], before[name])


def test_resume_in_the_middle_of_the_hold_is_bitwise_exact(data_dir, tmp_path):
    # Checkpoints at steps 4, 8 and 12; resuming from step 4 holds two more updates, then releases.
    data = data_dir / "pretrain.jsonl"
    flags = ["--batch_size", "8", "--epochs", "2", "--learning_rate", "2e-3", "--save_interval", "4",
             "--keep_checkpoints", "3", "--key_shift", "2", "--query_shift", "1", "--wide_shift_from_step", "6"]
    assert run_stage(train_pretrain, tmp_path, data, *flags) == 0
    reference = read_metrics(tmp_path)
    for step in (8, 12):
        (tmp_path / "checkpoints" / f"step_{step:07d}.pt").unlink()
    assert run_stage(train_pretrain, tmp_path, data, *flags, "--from_resume", "1") == 0
    assert deterministic_fields(read_metrics(tmp_path)) == deterministic_fields(reference)


def test_resume_with_a_distractor_memory_is_bitwise_exact(data_dir, tmp_path):
    """The distractor memory (ann_distractor_memory) travels in the checkpoint: a run resumed from
    step 4 continues as the uninterrupted one, whose losses the memory changes."""
    data = data_dir / "pretrain.jsonl"
    flags = ["--batch_size", "4", "--epochs", "1", "--max_steps", "8", "--save_interval", "4", "--keep_checkpoints", "2",
             "--ann_window", "8", "--ann_block_size", "4", "--ann_top_n", "2", "--ann_batch_distractors"]
    assert run_stage(train_pretrain, tmp_path / "plain", data, *flags) == 0
    assert run_stage(train_pretrain, tmp_path / "kept", data, *flags, "--ann_distractor_memory", "3") == 0
    reference = read_metrics(tmp_path / "kept")
    assert [r["loss"] for r in reference][1:] != [r["loss"] for r in read_metrics(tmp_path / "plain")][1:]
    assert MiniMindForCausalLM.from_pretrained(tmp_path / "kept" / "model").config.ann_distractor_memory == 3
    saved = torch.load(tmp_path / "kept" / "checkpoints" / "step_0000004.pt", weights_only=False)["training_state"]
    assert [len(entries) for entries in saved[0].values()] == [3, 3]
    (tmp_path / "kept" / "checkpoints" / "step_0000008.pt").unlink()
    assert run_stage(train_pretrain, tmp_path / "kept", data, *flags, "--ann_distractor_memory", "3",
                     "--from_resume", "1") == 0
    assert deterministic_fields(read_metrics(tmp_path / "kept")) == deterministic_fields(reference)


def test_only_the_wide_shift_group_waits_for_its_step():
    config = MiniMindConfig.from_preset("tiny", hidden_size=32, num_hidden_layers=1, key_shift=2, query_shift=1)
    model = MiniMindForCausalLM(config)
    optimizer = build_optimizer(model, learning_rate=1e-3)
    held = {id(p) for group in optimizer.param_groups if group.get("wide_shift") for p in group["params"]}
    assert held == {id(model.model.layers[0].self_attn.k_shift_wide), id(model.model.layers[0].self_attn.q_shift)}
    for step, held_lr in ((0, 0.0), (2, 0.0), (3, learning_rate_at(3, 10, 1e-3, 2)), (9, learning_rate_at(9, 10, 1e-3, 2))):
        lr = set_learning_rates(optimizer, step, total_steps=10, peak=1e-3, warmup_steps=2, wide_shift_from_step=3)
        assert lr == learning_rate_at(step, 10, 1e-3, 2) > 0
        assert [group["lr"] for group in optimizer.param_groups] == [lr, lr, held_lr]
    lr = set_learning_rates(optimizer, 5, total_steps=10, peak=1e-3, warmup_steps=2, wide_shift_from_step=3,
                            wide_shift_scale=10.0)
    assert [group["lr"] for group in optimizer.param_groups] == [lr, lr, 10.0 * lr]
    narrow = MiniMindConfig.from_preset("tiny", hidden_size=32, num_hidden_layers=1, key_shift=1)
    assert len(build_optimizer(MiniMindForCausalLM(narrow), 1e-3).param_groups) == 2  # nothing to hold


def old_layout(state_dict):
    """A state dict as saved before k_shift was split: each layer's key rows in one (key_shift, c) k_shift."""
    old = dict(state_dict)
    for name in [name for name in old if name.endswith("k_shift_wide")]:
        first = name.removesuffix("_wide")
        old[first] = torch.cat([old[first], old.pop(name)])
    return old


def test_weights_saved_before_the_key_shift_split_load(tmp_path):
    config = MiniMindConfig.from_preset("tiny", hidden_size=32, num_hidden_layers=2, key_shift=2, query_shift=1)
    model = MiniMindForCausalLM(config).eval()
    for weights in shift_weights(dict(model.named_parameters())).values():
        torch.nn.init.normal_(weights)
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.k_shift)
    old = old_layout(model.state_dict())
    assert old["model.layers.1.self_attn.k_shift"].shape == (2, 32) and not any("wide" in name for name in old)

    from_checkpoint = MiniMindForCausalLM(config).eval()
    from_checkpoint.load_state_dict(old)  # strict: every key used, none missing
    model.save_pretrained(tmp_path)
    tied = {name: value for name, value in old.items() if name != "lm_head.weight"}  # save_pretrained drops it
    save_file({name: value.contiguous() for name, value in tied.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    from_folder = MiniMindForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(3, config.vocab_size, (2, 24))
    for loaded in (from_checkpoint, from_folder):
        for name, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)  # same weights, same computation


def test_resume_after_sigkill_is_bitwise_exact(data_dir, tmp_path):
    # 48 samples, 4 x 2 accumulation -> 6 steps per epoch; 36 steps cross five epoch boundaries.
    data = data_dir / "pretrain.jsonl"
    flags = ["--batch_size", "4", "--accumulation_steps", "2", "--epochs", "6", "--save_interval", "4"]
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    assert run_stage(train_pretrain, reference_dir, data, *flags) == 0
    reference = read_metrics(reference_dir)
    assert len(reference) == 36

    command = [sys.executable, "-m", "trainer.train_pretrain", "--out_dir", str(killed_dir), "--data_path", str(data),
               *SMALL_MODEL, "--log_interval", "1", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics_path = killed_dir / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and process.poll() is None:
        if metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 11:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    killed_at = len(read_metrics(killed_dir))
    assert 11 <= killed_at < 36

    assert run_stage(train_pretrain, killed_dir, data, *flags, "--from_resume", "1") == 0
    assert deterministic_fields(read_metrics(killed_dir)) == deterministic_fields(reference)


def test_corrupt_latest_checkpoint_is_skipped(data_dir, tmp_path, capsys):
    data = data_dir / "pretrain.jsonl"
    args = ("--batch_size", "8", "--epochs", "4", "--max_steps", "12")
    args += ("--save_interval", "4", "--keep_checkpoints", "3")
    assert run_stage(train_pretrain, tmp_path, data, *args) == 0
    original = read_metrics(tmp_path)
    latest = tmp_path / "checkpoints" / "step_0000012.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a write cut short
    capsys.readouterr()

    assert run_stage(train_pretrain, tmp_path, data, *args, "--from_resume", "1") == 0
    output = capsys.readouterr()
    assert "skipping unreadable checkpoint" in output.err and "step_0000012.pt" in output.err
    assert "resumed from" in output.out and "step_0000008.pt" in output.out
    assert (tmp_path / "checkpoints" / "step_0000012.pt.corrupt").exists()
    # Steps 9-12 are trained again from step 8 and come out the same.
    assert deterministic_fields(read_metrics(tmp_path)) == deterministic_fields(original)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch_size", "0"], "--batch_size must be >= 1"),
        (["--max_steps", "0"], "--max_steps must be -1"),
        (["--epochs", "-1"], "--epochs must be >= 1"),
        (["--learning_rate", "-1"], "--learning_rate must be a positive number"),
        (["--attn", "sparse"], "attn_impl must be one of"),
        (["--hidden_size", "60"], "must divide hidden_size"),
        (["--ann_window", "40", "--ann_block_size", "16"], "must be a multiple of ann_block_size"),
        (["--ann_retrieval", "faiss"], "ann_retrieval must be one of"),
        (["--ann_block_position", "far"], "ann_block_position must be one of"),
        (["--ann_block_summary", "median"], "ann_block_summary must be one of"),
        (["--num_attention_heads", "8", "--num_key_value_heads", "3"], "must divide num_attention_heads"),
        (["--from_weight", "no/such/folder"], "not a saved model folder"),
        (["--hnsw_ef_search", "0"], "hnsw_ef_search must be a positive integer"),
        (["--wide_shift_from_step", "-1"], "--wide_shift_from_step must be >= 0"),
        (["--wide_shift_lr_scale", "0"], "--wide_shift_lr_scale must be a positive number"),
        (["--wide_shift_from_step", "5", "--key_shift", "1"], "holds back a token shift the model does not have"),
        (["--use_wandb"], "wandb"),
    ],
)
def test_bad_arguments_exit_2_before_reading_data(flags, message, tmp_path, capsys):
    if flags == ["--use_wandb"] and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed")
    # The data file is broken too: had it been read, the error would be about line 1.
    bad_data = tmp_path / "broken.jsonl"
    bad_data.write_text("{not json\n")
    assert run_stage(train_pretrain, tmp_path / "out", bad_data, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_bad_argument_as_a_script_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "trainer/train_full_sft.py", "--attn", "sparse", "--out_dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,  # a hang guard, not a speed check
    )
    assert result.returncode == 2
    assert "attn_impl must be one of" in result.stderr and "Traceback" not in result.stderr


def test_non_finite_loss_stops_with_exit_3(data_dir, tmp_path, capsys):
    code = run_stage(
        train_pretrain, tmp_path, data_dir / "pretrain.jsonl",
        "--batch_size", "8", "--learning_rate", "1e30", "--max_steps", "10", "--save_interval", "1",
    )
    assert code == 3
    err = capsys.readouterr().err
    records = read_metrics(tmp_path)
    bad_step = len(records) + 1
    assert f"non-finite loss (nan) at step {bad_step}" in err or f"non-finite loss (inf) at step {bad_step}" in err
    last_good = tmp_path / "checkpoints" / f"step_{bad_step - 1:07d}.pt"
    assert f"Last good checkpoint: {last_good}" in err and last_good.exists()
    assert not (tmp_path / "model").exists()
