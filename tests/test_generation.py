"""Generation the transformers way: GenerationMixin.generate, streamers, pipelines, chunked prefill,
parity with LlamaForCausalLM.generate, and the save_pretrained folder loaded with trust_remote_code
in a fresh process that has never seen the repository.

Models are tiny (hidden 64, 2 layers) with the shipped tokenizer's vocabulary. Their weights are
drawn wider than the training init so greedy continuations vary from token to token (the 0.02
init repeats one token) and the top-2 margins are far above the float tolerances.
"""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, TextIteratorStreamer, TextStreamer, pipeline

from model import MiniMindConfig, MiniMindForCausalLM
from model.model import CACHE_NAME
from tests.test_parity import llama_twin

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO_ROOT / "model" / "tokenizer"
TOLERANCE = 1e-4
# ANN with a 16-token window, 8-token blocks and top 2: prompts of 40+ tokens retrieve blocks.
ANN = dict(attn_impl="ann", ann_window=16, ann_block_size=8, ann_top_n=2)
KINDS = {"dense": dict(attn_impl="dense"), "ann_exact": dict(ANN, ann_retrieval="exact"),
         "ann_hnsw": dict(ANN, ann_retrieval="hnsw")}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def tiny_model(kind, seed=0):
    torch.manual_seed(seed)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=6400, max_position_embeddings=512, **KINDS[kind])
    model = MiniMindForCausalLM(config).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(std=0.3)
    return model


@pytest.fixture(scope="module", params=list(KINDS))
def model(request):
    """Every attention core and retriever: for what the cache must get right."""
    return tiny_model(request.param)


@pytest.fixture(scope="module", params=["dense", "ann_exact"])
def light_model(request):
    """Dense and one ANN retriever: for generate features layered above the cache."""
    return tiny_model(request.param)


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 6400, (1, length), generator=generator) for length in lengths]


def left_padded(rows, pad_id=0):
    """rows [(1, s_i)] -> input_ids (b, max s_i) padded on the left, attention_mask (b, max s_i)."""
    width = max(row.shape[1] for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, width - row.shape[1] :] = row[0]
        mask[index, width - row.shape[1] :] = 1
    return input_ids, mask


def greedy(model, input_ids, new_tokens, **kwargs):
    """generate() greedy for exactly new_tokens -> (new tokens (b, n), raw logits (b, n, vocab))."""
    out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences[:, input_ids.shape[1] :], torch.stack(out.logits, dim=1)


def assert_same_continuation(a, b):
    """Two (tokens, logits) pairs from different computations: equal tokens, logits within TOLERANCE."""
    assert torch.equal(a[0], b[0])
    assert (a[1] - b[1]).abs().max().item() <= TOLERANCE


def test_greedy_is_the_argmax_of_full_forwards_with_and_without_cache(model):
    prompt = prompts([45])[0]
    tokens, _ = greedy(model, prompt, 12)
    assert len(set(tokens[0].tolist())) > 3  # the continuation is not one repeated token
    sequence = prompt
    for _ in range(12):
        sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, sequence[:, 45:])
    assert torch.equal(greedy(model, prompt, 12, use_cache=False)[0], tokens)
    embeds = model.get_input_embeddings()(prompt)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(from_embeds, tokens)  # generate returns only the new tokens for inputs_embeds


def test_sampling_is_seeded_and_honours_top_k_top_p_and_temperature(light_model):
    prompt = prompts([45])[0]
    settings = dict(max_new_tokens=16, min_new_tokens=16, do_sample=True, temperature=1.5, top_k=5)

    def sample(seed, **overrides):
        torch.manual_seed(seed)
        return light_model.generate(prompt, **{**settings, **overrides})[:, 45:]

    first = sample(0)
    assert torch.equal(sample(0), first)  # the same computation repeated
    assert not torch.equal(sample(1), first)
    logits = light_model(torch.cat([prompt, first], dim=1)).logits[0, 44:-1]  # the logits each token was drawn from
    assert bool((first[0, :, None] == logits.topk(5, dim=-1).indices).any(dim=-1).all())
    greedy_tokens = greedy(light_model, prompt, 16)[0]
    assert torch.equal(sample(2, top_k=1), greedy_tokens)
    assert torch.equal(sample(3, top_k=0, top_p=1e-6), greedy_tokens)  # top_p keeps only the top token
    assert torch.equal(sample(4, top_k=0, temperature=1e-4), greedy_tokens)


@pytest.mark.parametrize("prefill_chunk_size", [None, 16], ids=["one_shot", "chunks_of_16"])
def test_left_padded_batch_equals_each_row_alone(model, prefill_chunk_size):
    rows = prompts([50, 27, 41])  # the 23 padding tokens of row 1 span more than one chunk
    input_ids, mask = left_padded(rows)
    tokens, logits = greedy(model, input_ids, 10, attention_mask=mask, prefill_chunk_size=prefill_chunk_size)
    for index, row in enumerate(rows):
        assert_same_continuation((tokens[index : index + 1], logits[index : index + 1]), greedy(model, row, 10))


def test_chunked_prefill_equals_one_shot(model):
    prompt = prompts([70])[0]
    one_shot = greedy(model, prompt, 10)
    for chunk in (7, 16, 64):
        assert_same_continuation(greedy(model, prompt, 10, prefill_chunk_size=chunk), one_shot)
    streamed = torch.stack(list(model.stream_generate(prompt, max_new_tokens=10, eos_token_id=-1, prefill_chunk=16)))
    assert torch.equal(streamed.T, one_shot[0])


def test_eos_stops_each_row_and_pads_it_until_all_are_done(light_model):
    rows = prompts([40, 33])
    input_ids, mask = left_padded(rows)
    free_run, _ = greedy(light_model, input_ids, 12, attention_mask=mask)
    eos = int(free_run[0, 2])
    first_in_row_1 = (free_run[1] == eos).nonzero()
    assert eos not in free_run[0, :2].tolist() and (len(first_in_row_1) == 0 or int(first_in_row_1[0]) > 2)
    stopped = light_model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                   eos_token_id=eos, pad_token_id=0)[:, input_ids.shape[1] :]
    row_1_end = 12 if len(first_in_row_1) == 0 else int(first_in_row_1[0]) + 1
    assert stopped.shape[1] == row_1_end  # generation ends when the last row is done
    assert torch.equal(stopped[0, :3], free_run[0, :3]) and bool((stopped[0, 3:] == 0).all())
    assert torch.equal(stopped[1], free_run[1, :row_1_end])
    alone = light_model.generate(rows[0], max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert alone.shape[1] == 40 + 3 and int(alone[0, -1]) == eos


def test_text_streamer_and_iterator_streamer_receive_the_text(light_model, tokenizer, capsys):
    input_ids = torch.tensor([tokenizer("The river runs").input_ids])
    new_tokens, _ = greedy(light_model, input_ids, 12)
    expected = tokenizer.decode(new_tokens[0])
    capsys.readouterr()
    light_model.generate(input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == expected + "\n"

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, streamer=streamer)
    worker = threading.Thread(target=light_model.generate, args=(input_ids,), kwargs=kwargs)
    worker.start()
    pieces = list(streamer)
    worker.join()
    assert "".join(pieces) == expected and len(pieces) > 1


def test_pipeline_text_generation_for_text_chat_and_batches(light_model, tokenizer):
    generator = pipeline("text-generation", model=light_model, tokenizer=tokenizer)
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)

    def expected(ids):
        return tokenizer.decode(greedy(light_model, torch.tensor([ids]), 8)[0][0], skip_special_tokens=True)

    text = "Once upon a time"
    out = generator(text, return_full_text=False, **settings)
    assert out[0]["generated_text"] == expected(tokenizer(text).input_ids)

    messages = [{"role": "user", "content": "Say hi."}]
    chat = generator(messages, **settings)[0]["generated_text"]
    assert chat[:-1] == messages and chat[-1]["role"] == "assistant"
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat[-1]["content"] == expected(prompt_ids)

    tokenizer.padding_side = "left"
    try:
        texts = ["A short one", "A much longer prompt that needs left padding in the batch"]
        batched = generator(texts, batch_size=2, return_full_text=False, **settings)
    finally:
        tokenizer.padding_side = "right"
    assert [rows[0]["generated_text"] for rows in batched] == [expected(tokenizer(t).input_ids) for t in texts]


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_greedy_equals_llama_generate_on_the_same_weights(num_kv_heads):
    torch.manual_seed(0)
    ours = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=num_kv_heads, vocab_size=6400)).eval()
    with torch.no_grad():
        for weight in ours.parameters():
            if weight.dim() > 1:
                weight.normal_(std=0.3)
    reference = llama_twin(ours)
    input_ids, mask = left_padded(prompts([30, 19]))
    ours_out = greedy(ours, input_ids, 16, attention_mask=mask)
    assert len(set(ours_out[0][0].tolist())) > 3
    assert_same_continuation(ours_out, greedy(reference, input_ids, 16, attention_mask=mask))
    assert_same_continuation(greedy(ours, input_ids[:1], 16), greedy(reference, input_ids[:1], 16))


def test_a_returned_cache_continues_the_generation(model):
    input_ids, mask = left_padded(prompts([40, 25]))
    in_one_go = greedy(model, input_ids, 10, attention_mask=mask)
    first = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True)
    mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
    rest = greedy(model, first.sequences, 6, attention_mask=mask, **{CACHE_NAME: first[CACHE_NAME]})
    assert torch.equal(torch.cat([first.sequences[:, 40:], rest[0]], dim=1), in_one_go[0])
    assert (rest[1] - in_one_go[1][:, 4:]).abs().max().item() <= TOLERANCE


def test_stream_generate_yields_generate_tokens_and_stops_when_closed(light_model):
    rows = prompts([45, 30])
    input_ids, mask = left_padded(rows)
    tokens, _ = greedy(light_model, input_ids, 8, attention_mask=mask)
    steps = list(light_model.stream_generate(input_ids, attention_mask=mask, max_new_tokens=8, eos_token_id=-1))
    assert len(steps) == 8 and all(step.shape == (2,) for step in steps)
    assert torch.equal(torch.stack(steps, dim=1), tokens)
    torch.manual_seed(5)
    sampled = torch.stack(list(light_model.stream_generate(rows[0], max_new_tokens=8, temperature=0.9, top_k=20)))
    torch.manual_seed(5)
    generated = light_model.generate(rows[0], max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=1.0)
    assert torch.equal(sampled[:, 0], generated[0, 45:])  # the same sampling, seeded alike

    stream = light_model.stream_generate(rows[0], max_new_tokens=400)
    next(stream)
    stream.close()  # stops generation and waits for its worker thread
    assert not any(thread.name == "generate" for thread in threading.enumerate())
    assert list(light_model.stream_generate(rows[0], max_new_tokens=0)) == []


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, ids: m.generate(ids, max_new_tokens=3, num_beams=2), "beam search is not supported"),
        (lambda m, ids: m.generate(ids, max_new_tokens=3, **{CACHE_NAME: DynamicCache()}),
         "cache must be a MiniMindCache"),
        (lambda m, ids: m.generate(ids, max_new_tokens=3, cache_implementation="static"), "not supported"),
        (lambda m, ids: m.generate(ids, max_new_tokens=3, prefill_chunk=8), "not used by the model: ['prefill_chunk']"),
        (lambda m, ids: next(m.stream_generate(ids, top_p=0)), "top_p must be in (0, 1]"),
        (lambda m, ids: next(m.stream_generate(ids, attention_mask=torch.tensor([[1, 0] * 10]))), "one contiguous run"),
        (lambda m, ids: m(ids[:, 5:], attention_mask=torch.tensor([[1] * 15 + [0] * 5]), cache=prefilled(m, ids)),
         "padding after a row's first real token"),
    ],
    ids=["beams", "foreign_cache", "static_cache", "typo_kwarg", "bad_top_p", "mask_with_holes", "padding_mid_row"],
)
def test_unsupported_requests_fail_with_a_clear_message(call, message):
    model = tiny_model("dense")
    with pytest.raises(ValueError, match=re.escape(message)):
        call(model, prompts([20])[0])


def prefilled(model, input_ids):
    cache = model.new_cache()
    model(input_ids[:, :5], cache=cache, use_cache=True)
    return cache


# Runs in a fresh interpreter whose cwd and sys.path have never seen the repository.
REMOTE_SCRIPT = r"""
import importlib.util, json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

assert importlib.util.find_spec("model") is None, "the repository's model package is importable"
results = {}
for folder, prompt in json.loads(sys.argv[1]):
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # else transformers asks about config.py
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    input_ids = torch.tensor([prompt])
    tokens = model.generate(input_ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(prompt):]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    generator = pipeline("text-generation", model=folder, trust_remote_code=True)
    text = generator("Once upon a time", max_new_tokens=6, min_new_tokens=6, do_sample=False, return_full_text=False)
    results[folder] = {"tokens": tokens.tolist(), "module": type(model).__module__, "chat": chat,
                       "text": text[0]["generated_text"]}
print(json.dumps(results))
"""


def test_saved_folder_loads_with_trust_remote_code_in_a_fresh_process(tokenizer, tmp_path):
    jobs, expected = [], {}
    for kind in ("dense", "ann_hnsw"):
        model = tiny_model(kind)
        folder = tmp_path / f"export_{kind}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"] == {"AutoConfig": "config.MiniMindConfig",
                                      "AutoModelForCausalLM": "model.MiniMindForCausalLM"}
        code_files = {path.name for path in folder.glob("*.py")}
        assert code_files == {path.name for path in (REPO_ROOT / "model").glob("*.py")} - {"__init__.py"}
        prompt = prompts([40])[0]
        story = torch.tensor([tokenizer("Once upon a time").input_ids])
        expected[str(folder)] = (greedy(model, prompt, 10)[0][0].tolist(),
                                 tokenizer.decode(greedy(model, story, 6)[0][0], skip_special_tokens=True))
        jobs.append((str(folder), prompt[0].tolist()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", REMOTE_SCRIPT, json.dumps(jobs)], cwd=elsewhere, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    for folder, (tokens, text) in expected.items():
        assert loaded[folder]["module"].startswith("transformers_modules.")
        assert loaded[folder]["tokens"] == tokens
        assert loaded[folder]["text"] == text
        assert loaded[folder]["chat"] == chat
