"""The OpenAI-compatible server (scripts/serve_openai_api.py, serving/): the official openai client,
raw HTTP for refused requests, the prefix cache across turns, concurrent and disconnecting clients.

The server is tests/serving_server.py's: a tiny ANN model, an API key, a 1024-token context, 16-token
prefill chunks (prompts are prefilled in several steps and retrieve blocks).
Greedy answers are checked against model.generate on the same weights in this process.
"""

import json
import threading
import urllib.request

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from dataset.chat_messages import template_messages
from serving.engine import next_token
from serving.prefix_cache import PrefixCache, cache_bytes
from serving.text_stream import TextStream
from tests.serving_server import API_KEY, CONTEXT, MAX_BODY, MAX_TOKENS_CAP, REPO_ROOT, shared_server, tiny_model

DOCUMENT = ("The river runs past the old mill, where the miller keeps his grain in seven tall sacks. "
            "Every morning the heron waits by the weir for the fish that the current brings down.")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO_ROOT / "model" / "tokenizer")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=f"{served[0].url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def greedy_answer(model, tokenizer, prompt_ids, max_tokens):
    """(text, token count) of model.generate's greedy answer, stopping at eos as the server does."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id)[0, len(prompt_ids) :]
    return tokenizer.decode(out, skip_special_tokens=True), len(out)


def post(server, path, body, key=API_KEY, raw=None):
    """(status, JSON body, headers) of a POST with a JSON (or raw bytes) body."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    response = httpx.post(f"{server.url}{path}", content=raw if raw is not None else json.dumps(body),
                          headers=headers, timeout=60)
    return response.status_code, response.json(), response.headers


def test_tool_and_reasoning_messages_render_as_in_sft(served, tokenizer):
    """The SFT record shapes (tools, tool calls, tool results, reasoning) are accepted in `messages`
    and rendered by the chat template exactly as the SFT data is."""
    server, _ = served
    tools = [{"type": "function", "function": {"name": "mill_stock", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "How many sacks does the miller keep?"},
        {"role": "assistant", "content": None, "reasoning_content": "The mill has a stock tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "mill_stock", "arguments": "{\"item\": \"grain\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]
    status, reply, _ = post(server, "/v1/chat/completions",
                            {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 2})
    expected = tokenizer.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True,
                                             tokenize=True)["input_ids"]
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(expected)
    orphan = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "7"}]
    status, error, _ = post(server, "/v1/chat/completions", {"model": "tiny", "messages": orphan})
    assert status == 400 and "messages[1]" in error["error"]["message"] and error["error"]["param"] == "messages"


def test_models_and_health(served, client):
    server, _ = served
    assert [model.id for model in client.models.list().data] == ["tiny"]
    health = server.health()
    assert health["status"] == "ok" and health["active"] == 0 and health["model"] == "tiny"


def test_chat_greedy_equals_generate_and_reports_usage(served, client, tokenizer):
    server, model = served
    messages = [{"role": "user", "content": "Tell me about the river and the mill."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    prompt_ids = chat_ids(tokenizer, messages)
    text, count = greedy_answer(model, tokenizer, prompt_ids, 12)
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if count == 12 else "stop")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), count)
    assert reply.usage.total_tokens == len(prompt_ids) + count


def test_completion_greedy_equals_generate(served, client, tokenizer):
    server, model = served
    prompt = "Once upon a time the heron"
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    text, count = greedy_answer(model, tokenizer, tokenizer(prompt, add_special_tokens=False).input_ids, 10)
    assert reply.choices[0].text == text and reply.usage.completion_tokens == count


def test_streaming_chat_yields_the_same_text_then_usage_and_done(served, client, tokenizer):
    server, model = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does the heron do?"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text, count = greedy_answer(model, tokenizer, chat_ids(tokenizer, messages), 10)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    assert sum(bool(chunk.choices and chunk.choices[0].delta.content) for chunk in chunks) > 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count

    body = {"messages": messages, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["object"] == "chat.completion.chunk"


def test_stop_strings_end_the_answer_before_them(served, client, tokenizer):
    server, model = served
    prompt = "The miller keeps his grain"
    text, _ = greedy_answer(model, tokenizer, tokenizer(prompt, add_special_tokens=False).input_ids, 16)
    clean = text.split("\ufffd")[0]  # a stop made of whole characters
    assert len(clean) >= 6
    stop = clean[len(clean) // 2 : len(clean) // 2 + 2]
    expected = text[: text.find(stop)]
    for stops in (stop, ["never appears here", stop]):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stops)
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_sampling_is_seeded(served, client):
    settings = dict(model="tiny", prompt="The heron waits", max_tokens=12, temperature=1.0, top_p=0.9)
    first = client.completions.create(seed=7, **settings).choices[0].text
    assert client.completions.create(seed=7, **settings).choices[0].text == first  # the same computation
    assert any(client.completions.create(seed=seed, **settings).choices[0].text != first for seed in (8, 9, 10))


def test_a_follow_up_turn_prefills_only_its_new_tokens(served, tokenizer):
    server, model = served
    first_turn = [{"role": "user", "content": DOCUMENT + " Who waits by the weir?"}]
    status, reply, headers = post(server, "/v1/chat/completions", {"messages": first_turn, "max_tokens": 6,
                                                                    "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 6
    answer = reply["choices"][0]["message"]["content"]
    first_prompt = reply["usage"]["prompt_tokens"]
    assert int(headers["x-prefilled-tokens"]) == first_prompt - reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    second_turn = first_turn + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    status, reply, headers = post(server, "/v1/chat/completions", {"messages": second_turn, "max_tokens": 4,
                                                                    "temperature": 0})
    assert status == 200
    expected = greedy_answer(model, tokenizer, chat_ids(tokenizer, second_turn), 4)[0]
    assert reply["choices"][0]["message"]["content"] == expected  # the reused cache continues correctly
    # The finished cache (prompt and the 5 answer tokens fed back) is kept when the answer's text
    # tokenizes back to its ids; the copy taken before the prompt's last token always is.
    answer_ids = model.generate(torch.tensor([chat_ids(tokenizer, first_turn)]), max_new_tokens=6,
                                do_sample=False)[0, -6:-1].tolist()
    round_trips = tokenizer(answer, add_special_tokens=False).input_ids[:5] == answer_ids
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (first_prompt + 5 if round_trips else first_prompt - 1)
    assert int(headers["x-cached-tokens"]) == cached
    assert int(headers["x-prefilled-tokens"]) == reply["usage"]["prompt_tokens"] - cached < first_prompt

    status, again, headers = post(server, "/v1/chat/completions", {"messages": second_turn, "max_tokens": 4,
                                                                    "temperature": 0})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == reply["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == expected


def test_eight_concurrent_streams_all_complete_with_their_own_answers(served, tokenizer):
    server, model = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    questions = [f"Question {index}: what is in sack number {index}?" for index in range(8)]
    answers = {}

    def ask(question):
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                max_tokens=24, temperature=0, stream=True)
        answers[question] = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    threads = [threading.Thread(target=ask, args=(question,)) for question in questions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for question in questions:
        ids = chat_ids(tokenizer, [{"role": "user", "content": question}])
        assert answers[question] == greedy_answer(model, tokenizer, ids, 24)[0]


def test_a_disconnected_client_is_cancelled_and_health_answers_meanwhile(served, client):
    server, _ = served
    cancelled_before = server.health()["cancelled"]
    body = {"prompt": DOCUMENT, "max_tokens": MAX_TOKENS_CAP - 100, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        next(lines)
        during = server.health(timeout=10)  # while the long answer is being generated
    assert during["status"] == "ok" and during["active"] == 1
    for _ in range(200):
        health = server.health()
        if health["active"] == 0:
            break
        threading.Event().wait(0.05)
    assert health["active"] == 0 and health["cancelled"] == cancelled_before + 1
    reply = client.completions.create(model="tiny", prompt="Still there?", max_tokens=3)
    assert reply.usage.completion_tokens >= 1


def test_a_wrong_or_missing_api_key_gets_401(served):
    server, _ = served
    body = {"prompt": "hi", "max_tokens": 2}
    for key in (None, "wrong-key"):
        status, reply, _ = post(server, "/v1/completions", body, key=key)
        assert status == 401 and reply["error"]["type"] == "authentication_error"
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:  # needs no key
        assert response.status == 200


LONG_PROMPT = "the river runs " * 400  # over 1024 tokens
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "path, body, raw, status, param",
    [
        ("/v1/chat/completions", None, b"{not json", 400, None),
        ("/v1/chat/completions", None, b"[1, 2]", 400, None),
        ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, None, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, None, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, None, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, None, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": MAX_TOKENS_CAP + 1}, None, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "ten"}, None, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, None, 400, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, None, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT, "stop": [1, 2]}, None, 400, "stop"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, None, 400, "stream"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, None, 400, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, None, 400, "messages"),
        ("/v1/completions", {"prompt": "hi " * 100, "max_tokens": MAX_TOKENS_CAP}, None, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, None, 400, "tools"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2}, None, 400, "logprobs"),
        ("/v1/completions", {"prompt": ""}, None, 400, "prompt"),
        ("/v1/completions", {"prompt": 42}, None, 400, "prompt"),
        ("/v1/completions", {"prompt": "x" * MAX_BODY}, None, 413, None),
        ("/v1/nowhere", {}, None, 404, None),
    ],
    ids=["invalid_json", "not_an_object", "messages_not_array", "empty_messages", "unknown_role", "content_not_text",
         "no_content", "zero_max_tokens", "negative_max_tokens", "max_tokens_over_cap", "max_tokens_not_int",
         "temperature_not_number", "zero_top_p", "stop_not_strings", "stream_not_bool", "several_choices",
         "prompt_over_context", "prompt_plus_answer_over_context", "tools", "logprobs", "empty_prompt", "prompt_not_text",
         "body_over_cap", "unknown_route"],
)
def test_bad_requests_get_openai_errors(served, path, body, raw, status, param):
    got_status, reply, _ = post(served[0], path, body, raw=raw)
    assert got_status == status
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["message"] and "Traceback" not in reply["error"]["message"]
    if status < 500 and status != 404:
        assert reply["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- library pieces, no server


def sized(nbytes):
    return torch.zeros(nbytes, dtype=torch.uint8)


def test_prefix_cache_takes_the_longest_full_prefix_and_removes_it():
    cache = PrefixCache(budget_bytes=1000)
    cache.put([1, 2], sized(10))
    cache.put([1, 2, 3, 4], sized(10))
    cache.put([1, 5], sized(10))
    assert cache.take([1, 2, 3]).token_ids == (1, 2)  # [1, 2, 3, 4] is not all in the prompt
    assert cache.take([1, 2, 3, 4, 9]).token_ids == (1, 2, 3, 4)
    assert cache.take([1, 2, 3, 4, 9]) is None  # both taken out
    assert cache.take([7]) is None and len(cache) == 1


def test_prefix_cache_evicts_least_recently_used_past_its_byte_budget():
    cache = PrefixCache(budget_bytes=100)
    for key in ([1], [2], [3]):
        cache.put(key, sized(40))
    assert list(cache.entries) == [(2,), (3,)] and cache.nbytes == 80
    cache.put(cache.take([2, 0]).token_ids, sized(40))  # used again: now the most recent
    assert cache.put([4], sized(40)) == [(3,)]
    assert cache.put([5], sized(500)) == [(5,)] and list(cache.entries) == [(2,), (4,)]  # over the whole budget


def test_cache_bytes_counts_kv_buffers_summaries_and_hnsw_graphs():
    model = tiny_model(512)
    sizes = {}
    for retrieval in ("exact", "hnsw"):
        model.config.ann_retrieval = retrieval  # the attention cores build their retrievers from it
        cache = model.new_cache()
        with torch.inference_mode():
            model(torch.randint(3, 6400, (1, 300)), cache=cache, use_cache=True)
        sizes[retrieval] = cache_bytes(cache)
    kv = sum(layer.k.untyped_storage().nbytes() + layer.v.untyped_storage().nbytes() for layer in cache.layers)
    assert kv < sizes["exact"] < sizes["hnsw"]


def test_text_stream_holds_back_what_may_start_a_stop_string(tokenizer):
    ids = tokenizer("The river runs past the mill", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, ["past the"])
    pieces = [stream.add(token) for token in ids]
    assert "".join(pieces) == "The river runs " and stream.stopped
    assert not any("past" in piece for piece in pieces)
    plain = TextStream(tokenizer, [])
    assert "".join(plain.add(token) for token in ids) + plain.finish() == "The river runs past the mill"


def test_next_token_is_the_argmax_at_temperature_zero_and_within_top_p():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    generator = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 1.0, generator) == 1
    assert {next_token(logits, 1.0, 0.5, generator) for _ in range(50)} == {1, 3}  # the two tokens over half
    assert next_token(logits, 1.0, 1e-6, generator) == 1
