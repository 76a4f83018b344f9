"""OpenAI request bodies -> what the engine runs, or an ApiError in OpenAI's error shape.

Chat messages (tool calls, tool results and reasoning included) and a request's `tools` are
checked by the same validator as the SFT records (dataset/chat_messages.py), so the server accepts
exactly the conversations the model is trained on, and rendered with the tokenizer's chat template.
"""

import json
import math
from dataclasses import dataclass

from dataset.chat_messages import conversation_problem, json_type, template_messages, tools_problem


class ApiError(Exception):
    """A request the server refuses: HTTP status and OpenAI's {"error": {...}} fields."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    context: int  # prompt + answer tokens
    max_tokens_cap: int


@dataclass
class Generation:
    """A validated request: the prompt ids and how to answer."""

    prompt_ids: list
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stops: list
    stream: bool
    include_usage: bool


def parse_body(raw):
    """The raw request body -> its JSON object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {json_type(body)}", code="invalid_json")
    return body


def number(body, name, default, low, high, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {json_type(value)}", param=name, code="invalid_type")
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ApiError(400, f"'{name}' must be in {interval}, got {value}", param=name, code="invalid_value")
    return float(value)


def integer(body, name):
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be an integer, got {json_type(value)}", param=name, code="invalid_type")
    return value


def flag(body, name):
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {json_type(value)}", param=name, code="invalid_type")
    return value


def stop_strings(body):
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(item, str) for item in stops) or len(stops) > 4:
        raise ApiError(400, f"'stop' must be a string or an array of up to 4 strings, got {json_type(stop)}",
                       param="stop", code="invalid_type")
    return stops


def message_text(content, where):
    """A message's content as one string: a string, or an array of {"type": "text", "text": ...} parts."""
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ApiError(400, f"{where}.content parts must be {{\"type\": \"text\", \"text\": string}} objects "
                           "(only text is supported)", param="messages", code="invalid_type")
        return "".join(part["text"] for part in content)
    return content


def chat_messages(body):
    """The request's messages, checked as an SFT conversation whose assistant reply is to come."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if messages == [] else json_type(messages)
        raise ApiError(400, f"'messages' must be a non-empty array of messages, got {got}", param="messages",
                       code="invalid_value")
    messages = [{**message, "content": message_text(message["content"], f"messages[{index}]")}
                if isinstance(message, dict) and "content" in message else message
                for index, message in enumerate(messages)]
    problem = conversation_problem(messages, "messages")
    if problem is not None:
        raise ApiError(400, problem, param="messages", code="invalid_value")
    return template_messages(messages)


def request_tools(body):
    """The request's function schemas (None when it has none), checked as a system turn's tools are."""
    name = "tools" if body.get("tools") is not None else "functions"
    tools = body.get(name)
    if tools is None:
        return None
    problem = tools_problem(tools, name)
    if problem is not None:
        raise ApiError(400, problem, param=name, code="invalid_value")
    return tools


def completion_prompt(body):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, f"'prompt' must be a non-empty string, got {json_type(prompt)}", param="prompt",
                       code="invalid_value")
    return prompt


# Fields whose non-default value would change the answer in a way this server does not implement.
UNSUPPORTED = {"tool_choice": (None, "auto"), "response_format": None, "logprobs": (None, False),
               "top_logprobs": None, "logit_bias": None, "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
               "best_of": (None, 1), "echo": (None, False), "suffix": None}


def refuse_unsupported(body):
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def generation(body, prompt_ids, limits, prompt_param):
    """The sampling fields of a chat or completion body, checked against the limits and the prompt."""
    refuse_unsupported(body)
    if integer(body, "n") not in (None, 1):
        raise ApiError(400, "'n' must be 1 (one answer per request)", param="n", code="invalid_value")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, name)
    room = limits.context - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {limits.context} "
                       "(prompt and answer)", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens_cap, room)
    elif not 1 <= max_tokens <= limits.max_tokens_cap:
        raise ApiError(400, f"'{name}' must be in [1, {limits.max_tokens_cap}], got {max_tokens}", param=name,
                       code="invalid_value")
    elif max_tokens > room:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens and '{name}' asks for {max_tokens}; the "
                       f"context holds {limits.context}", param=name, code="context_length_exceeded")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, got {json_type(options)}", param="stream_options",
                       code="invalid_type")
    return Generation(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=integer(body, "seed"),
        stops=stop_strings(body),
        stream=flag(body, "stream"),
        include_usage=flag(options or {}, "include_usage"),
    )


def check_model(body):
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {json_type(model)}", param="model", code="invalid_type")


def chat_generation(body, tokenizer, limits):
    check_model(body)
    messages = chat_messages(body)
    prompt_ids = tokenizer.apply_chat_template(messages, tools=request_tools(body), add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    return generation(body, list(prompt_ids), limits, "messages")


def completion_generation(body, tokenizer, limits):
    check_model(body)
    prompt_ids = tokenizer(completion_prompt(body), add_special_tokens=False).input_ids
    return generation(body, prompt_ids, limits, "prompt")
