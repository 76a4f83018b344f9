"""Plain induction (evaluation/induction.py, scripts/probe_induction.py): every attention, trained from
scratch on repeated random tokens, learns to copy, through retrieved blocks where the copy lies
beyond the ANN window."""

import json
import math

import pytest
import torch

from evaluation.induction import reading_losses, repeated_spans, train_induction
from model.config import MiniMindConfig
from model.model import MiniMindForCausalLM
from scripts import probe_induction

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=1e4, key_shift=1)


def test_repeated_spans_repeat_one_span_per_row():
    ids, span = repeated_spans(torch.Generator().manual_seed(0), 3, 50, 7, 12, VOCAB)
    assert ids.shape == (3, 50) and 7 <= span <= 12
    assert bool((ids[:, span:] == ids[:, :-span]).all())
    assert int(ids.min()) >= 3 and int(ids.max()) < VOCAB


def test_reading_losses_split_first_and_repeated_readings():
    ids, span = repeated_spans(torch.Generator().manual_seed(1), 2, 40, 10, 10, VOCAB)
    logits = torch.zeros(2, 40, VOCAB)
    logits[:, :-1].scatter_(2, ids[:, 1:, None], 50.0)  # certain of every next token
    logits[:, : span - 1] = 0.0  # uniform over the first reading
    first, repeated = reading_losses(logits, ids, span)
    assert first == pytest.approx(math.log(VOCAB), rel=1e-5)
    assert repeated < 1e-6


# Spans 20-40 against a 16-token window: every copy lies beyond the window. On this seed all three
# are below the bound by step 200 (1.9-2.3) and at 1.1-1.4 by step 300: ~100 steps of margin.
@pytest.mark.parametrize("attention", [
    dict(attn_impl="dense"),
    dict(attn_impl="ann", ann_window=16, ann_block_position="capped"),
    dict(attn_impl="ann", ann_window=16, ann_block_position="true"),
], ids=["dense", "ann_capped", "ann_true"])
def test_every_attention_learns_to_copy_far_back(attention):
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**SMALL, **attention))
    rows = train_induction(model, steps=300, lr=3e-3, batch=16, length=160, min_span=20, max_span=40, seed=0,
                           log_every=50)
    start, end = rows[0], rows[-1]
    assert start["repeated_nll"] > 4.0 and end["step"] == 300
    assert end["first_nll"] > 4.0, "the first reading is random: nothing to learn there"
    assert end["repeated_nll"] < 2.5, rows


def test_probe_induction_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "induction.json"
    assert probe_induction.main(["--vocab", "64", "--hidden_size", "32", "--heads", "2", "--length", "64",
                                 "--min_span", "8", "--max_span", "20", "--steps", "4", "--log_every", "2",
                                 "--json", str(out), "--save", str(tmp_path / "model")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["step"] for row in rows] == [0, 2, 4]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "repeated NLL" in capsys.readouterr().out
    saved = MiniMindForCausalLM.from_pretrained(tmp_path / "model")
    assert saved.config.vocab_size == 64 and saved.config.hidden_size == 32


@pytest.mark.parametrize("hold", [False, True], ids=["trained", "held"])
def test_probe_induction_holds_the_wide_shift(tmp_path, hold):
    argv = ["--vocab", "64", "--hidden_size", "32", "--heads", "2", "--length", "64", "--min_span", "8",
            "--max_span", "20", "--steps", "3", "--key_shift", "2", "--query_shift", "1", "--save", str(tmp_path)]
    assert probe_induction.main(argv + ["--hold_wide_shift"] * hold) == 0
    model = MiniMindForCausalLM.from_pretrained(tmp_path)
    layer = model.model.layers[0].self_attn
    assert layer.k_shift[0].abs().sum() > 0, "the one-token key shift trains either way"
    for weights in (layer.k_shift_wide, layer.q_shift):
        assert (weights.abs().sum() == 0) == hold


@pytest.mark.parametrize("argv, message", [
    (["--hold_wide_shift", "--key_shift", "1"], "--hold_wide_shift"),
    (["--min_span", "40", "--max_span", "30"], "--min_span"),
    (["--max_span", "200", "--length", "256"], "two readings"),
    (["--steps", "0"], "--steps"),
    (["--ann_window", "10"], "multiple of ann_block_size"),
])
def test_probe_induction_bad_arguments_exit_2(argv, message, capsys):
    assert probe_induction.main(argv) == 2
    assert message in capsys.readouterr().err
