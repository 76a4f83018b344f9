"""dataset/chat_messages.py and the shipped chat template: each accepted shape renders to its exact text,
the SFT loss covers exactly what the assistant writes, and each malformed shape gets its own message."""
import copy
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dataset.chat_messages import CHAT_TEMPLATE, conversation_problem, template_messages, tools_problem
from dataset.lm_dataset import DataFormatError, SFTDataset, sft_record_problem

REPO = Path(__file__).resolve().parent.parent
IGNORE = -100

WEATHER_SCHEMA = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                   "parameters": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}}}}
WEATHER_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", '
                '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}')
TOOLS_INSTRUCTIONS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
CALL_INSTRUCTIONS = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
USER = {"role": "user", "content": "Weather in 北京?"}
USER_TEXT = "<|im_start|>user\nWeather in 北京?<|im_end|>\n"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"北京"}'}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"北京"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(REPO / "model" / "tokenizer"))


def render(tokenizer, turns, **kwargs):
    return tokenizer.apply_chat_template(template_messages(turns), tokenize=False, **kwargs)


def test_the_shipped_tokenizer_carries_the_template_of_the_module():
    config = json.loads((REPO / "model" / "tokenizer" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHAT_TEMPLATE


# ----------------------------------------------------------------------------- rendering

RENDERED = {
    "plain": (
        [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Sunny."}],
        "<|im_start|>system\nBe brief.<|im_end|>\n" + USER_TEXT + "<|im_start|>assistant\nSunny.<|im_end|>\n"),
    "tools_list": (
        [{"role": "system", "content": "Be brief.", "tools": [WEATHER_SCHEMA]}, USER],
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_INSTRUCTIONS + WEATHER_JSON + CALL_INSTRUCTIONS + USER_TEXT),
    "tools_json_string": (
        [{"role": "system", "content": "Be brief.", "tools": json.dumps([WEATHER_SCHEMA])}, USER],
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_INSTRUCTIONS + WEATHER_JSON + CALL_INSTRUCTIONS + USER_TEXT),
    "functions_flat_schemas": (
        [{"role": "system", "content": "", "functions": [{"name": "now"}, {"name": "today"}]}, USER],
        "<|im_start|>system\n" + TOOLS_INSTRUCTIONS + '{"name": "now"}\n{"name": "today"}' + CALL_INSTRUCTIONS
        + USER_TEXT),
    "reasoning": (
        [USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "\nJust answer.\n"}],
        USER_TEXT + "<|im_start|>assistant\n<think>\nJust answer.\n</think>\n\nSunny.<|im_end|>\n"),
    "empty_reasoning": (
        [USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "\n"}],
        USER_TEXT + "<|im_start|>assistant\nSunny.<|im_end|>\n"),
    "call_without_content": (
        [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
        USER_TEXT + "<|im_start|>assistant\n" + CALL_TEXT + "<|im_end|>\n"),
    "calls_after_content_and_reasoning": (
        [USER, {"role": "assistant", "content": "Let me look.", "reasoning_content": "Two cities.",
                "tool_calls": [CALL, {"name": "get_weather", "arguments": {"city": "上海"}}]}],
        USER_TEXT + "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\nLet me look.\n" + CALL_TEXT
        + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "上海"}}\n</tool_call><|im_end|>\n'),
    "tool_results": (
        [USER, {"role": "assistant", "tool_calls": [CALL, CALL]},
         {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
         {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Sunny, then rain."}],
        USER_TEXT + "<|im_start|>assistant\n" + CALL_TEXT + "\n" + CALL_TEXT + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nSunny, then rain.<|im_end|>\n"),
}


@pytest.mark.parametrize("shape", RENDERED)
def test_each_shape_renders_to_its_exact_text(tokenizer, shape):
    turns, text = RENDERED[shape]
    assert conversation_problem(turns) is None
    assert render(tokenizer, turns) == text


def test_tools_given_to_apply_chat_template_form_their_own_system_turn(tokenizer):
    """How a chat server passes a request's tools: beside the messages, not on a system turn."""
    rendered = render(tokenizer, [USER], tools=[WEATHER_SCHEMA], add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\n" + TOOLS_INSTRUCTIONS + WEATHER_JSON + CALL_INSTRUCTIONS + USER_TEXT
                        + "<|im_start|>assistant\n")


def test_template_messages_leaves_the_turns_as_they_were():
    turns = RENDERED["tools_json_string"][0] + [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    before = copy.deepcopy(turns)
    messages = template_messages(turns)
    assert turns == before
    assert messages[0]["tools"] == [WEATHER_SCHEMA] and messages[2]["content"] == ""


# ----------------------------------------------------------------------------- loss mask

def test_sft_labels_are_exactly_what_the_assistant_writes(tmp_path, tokenizer):
    turns = [{"role": "system", "content": "Be brief.", "tools": [WEATHER_SCHEMA]}, USER,
             {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
             {"role": "assistant", "content": "Sunny in 北京."}]
    said = ["<think>\nNeed the tool.\n</think>\n\n" + CALL_TEXT + "<|im_end|>", "Sunny in 北京.<|im_end|>"]
    segments = [  # (text, is it the assistant's)
        ("<|im_start|>system\nBe brief.\n\n" + TOOLS_INSTRUCTIONS + WEATHER_JSON + CALL_INSTRUCTIONS + USER_TEXT
         + "<|im_start|>assistant\n", False), (said[0], True),
        ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
        (said[1], True), ("\n", False)]
    ids, labels = [], []
    for text, is_assistant in segments:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += tokens
        labels += tokens if is_assistant else [IGNORE] * len(tokens)
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n", encoding="utf-8")
    input_ids, got_labels = SFTDataset(path, tokenizer, max_length=len(ids))[0]
    assert input_ids.tolist() == ids
    assert got_labels.tolist() == labels
    assert tokenizer.decode([t for t in labels if t != IGNORE]) == "".join(said)


# ----------------------------------------------------------------------------- malformed shapes

def assistant_with(**fields):
    return {"role": "assistant", "content": None, **fields}


def call_with(**function):
    return {"type": "function", "function": {"name": "get_weather", "arguments": "{}", **function}}


MALFORMED = {
    "tools_bad_json": ([{"role": "system", "content": "", "tools": "[{"}, USER],
                       "conversations[0].tools is not valid JSON: Expecting property name enclosed in double quotes "
                       "(column 3)"),
    "tools_object": ([{"role": "system", "content": "", "tools": WEATHER_SCHEMA}, USER],
                     "conversations[0].tools must be an array of function schemas, got object"),
    "tools_item_string": ([{"role": "system", "content": "", "functions": ["get_weather"]}, USER],
                          "conversations[0].functions[0] must be an object, got string"),
    "tools_item_unnamed": ([{"role": "system", "content": "", "tools": [{"description": "x"}]}, USER],
                           "conversations[0].tools[0] is missing field 'name'"),
    "tools_function_unnamed": ([{"role": "system", "content": "", "tools": [{"type": "function", "function": {}}]},
                                USER], "conversations[0].tools[0].function is missing field 'name'"),
    "tools_and_functions": ([{"role": "system", "content": "", "tools": [], "functions": []}, USER],
                            "conversations[0] has both 'tools' and 'functions' (give one list)"),
    "tools_on_user": ([{"role": "user", "content": "hi", "tools": [WEATHER_SCHEMA]}],
                      "conversations[0].tools is only allowed on the first turn, a system turn"),
    "tools_on_later_system": ([USER, {"role": "system", "content": "", "functions": [WEATHER_SCHEMA]}],
                              "conversations[1].functions is only allowed on the first turn, a system turn"),
    "calls_on_user": ([{"role": "user", "content": "hi", "tool_calls": [CALL]}],
                      "conversations[0].tool_calls is only allowed on assistant turns (this one is 'user')"),
    "reasoning_on_tool": ([USER, assistant_with(tool_calls=[CALL]),
                           {"role": "tool", "content": "sunny", "reasoning_content": "hm"}],
                          "conversations[2].reasoning_content is only allowed on assistant turns (this one is 'tool')"),
    "reasoning_number": ([USER, {"role": "assistant", "content": "ok", "reasoning_content": 3}],
                         "conversations[1].reasoning_content must be a string, got number"),
    "content_null_without_calls": ([USER, assistant_with()], "conversations[1].content must be a string, got null"),
    "content_number_beside_calls": ([USER, assistant_with(content=1, tool_calls=[CALL])],
                                    "conversations[1].content must be a string, got number"),
    "calls_object": ([USER, assistant_with(tool_calls=CALL)],
                     "conversations[1].tool_calls must be an array, got object"),
    "call_string": ([USER, assistant_with(tool_calls=["get_weather()"])],
                    "conversations[1].tool_calls[0] must be an object, got string"),
    "call_type": ([USER, assistant_with(tool_calls=[{**call_with(), "type": "code"}])],
                  "conversations[1].tool_calls[0].type 'code' is unknown (expected 'function')"),
    "call_id_number": ([USER, assistant_with(tool_calls=[{**call_with(), "id": 7}])],
                       "conversations[1].tool_calls[0].id must be a string, got number"),
    "call_function_string": ([USER, assistant_with(tool_calls=[{"type": "function", "function": "get_weather"}])],
                             "conversations[1].tool_calls[0].function must be an object, got string"),
    "call_unnamed": ([USER, assistant_with(tool_calls=[{"function": {"arguments": "{}"}}])],
                     "conversations[1].tool_calls[0].function is missing field 'name'"),
    "call_empty_name": ([USER, assistant_with(tool_calls=[call_with(name="")])],
                        "conversations[1].tool_calls[0].function.name must be a non-empty string, got string"),
    "flat_call_without_arguments": ([USER, assistant_with(tool_calls=[CALL, {"name": "get_weather"}])],
                                    "conversations[1].tool_calls[1] is missing field 'arguments'"),
    "arguments_bad_json": ([USER, assistant_with(tool_calls=[call_with(arguments='{"city": ')])],
                           "conversations[1].tool_calls[0].function.arguments is not valid JSON: Expecting value "
                           "(column 10)"),
    "arguments_json_array": ([USER, assistant_with(tool_calls=[call_with(arguments='["北京"]')])],
                             "conversations[1].tool_calls[0].function.arguments must be an object or a JSON string "
                             "of one, got array"),
    "arguments_number": ([USER, assistant_with(tool_calls=[call_with(arguments=5)])],
                         "conversations[1].tool_calls[0].function.arguments must be an object or a JSON string "
                         "of one, got number"),
    "result_after_user": ([USER, {"role": "tool", "content": "sunny"}],
                          "conversations[1] is a tool result, but no assistant turn with tool_calls comes right "
                          "before it"),
    "result_after_plain_answer": ([USER, {"role": "assistant", "content": "ok", "tool_calls": []},
                                   {"role": "tool", "content": "sunny"}],
                                  "conversations[2] is a tool result, but no assistant turn with tool_calls comes "
                                  "right before it"),
    "more_results_than_calls": ([USER, assistant_with(tool_calls=[CALL]), {"role": "tool", "content": "sunny"},
                                 {"role": "tool", "content": "rain"}],
                                "conversations[3] is tool result 2 of conversations[1], which made 1 tool call(s)"),
    "result_for_unknown_call": ([USER, assistant_with(tool_calls=[CALL]),
                                 {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}],
                                "conversations[2].tool_call_id 'call_9' matches no call of conversations[1] "
                                "(ids: call_1)"),
    "result_null": ([USER, assistant_with(tool_calls=[CALL]), {"role": "tool", "content": None}],
                    "conversations[2].content must be a string, got null"),
    "result_id_number": ([USER, assistant_with(tool_calls=[CALL]), {"role": "tool", "tool_call_id": 1,
                                                                     "content": "sunny"}],
                         "conversations[2].tool_call_id must be a string, got number"),
    "unknown_role": ([USER, {"role": "function", "content": "sunny"}],
                     "conversations[1].role 'function' is unknown (expected one of: system, user, assistant, tool)"),
}


@pytest.mark.parametrize("shape", MALFORMED)
def test_each_malformed_shape_gets_its_own_message(shape):
    turns, problem = MALFORMED[shape]
    assert conversation_problem(turns) == problem
    assert sft_record_problem({"conversations": turns}) == problem


ACCEPTED = {
    "content_absent_beside_calls": [USER, {"role": "assistant", "tool_calls": [CALL]}],
    "null_optional_fields": [{"role": "system", "content": "s", "tools": None}, USER,
                             {"role": "assistant", "content": "ok", "reasoning_content": None, "tool_calls": None}],
    "result_ids_without_call_ids": [USER, assistant_with(tool_calls=[call_with()]),
                                    {"role": "tool", "tool_call_id": "anything", "content": "sunny"},
                                    {"role": "assistant", "content": "Sunny."}],
    "unknown_extra_fields": [{**USER, "name": "ann"}, {"role": "assistant", "content": "ok", "refusal": None}],
}


@pytest.mark.parametrize("shape", ACCEPTED)
def test_optional_and_null_fields_are_accepted(tokenizer, shape):
    assert conversation_problem(ACCEPTED[shape]) is None
    assert render(tokenizer, ACCEPTED[shape]).endswith("<|im_end|>\n")


def test_chat_requests_are_checked_by_the_same_rules_without_needing_an_answer():
    """A chat request's messages end before the answer; messages name the request's own fields."""
    assert conversation_problem([USER], name="messages") is None
    assert sft_record_problem({"conversations": [USER]}) == "conversation has no assistant turn"
    assert conversation_problem([USER, {"role": "tool", "content": "x"}], name="messages") == \
        "messages[1] is a tool result, but no assistant turn with tool_calls comes right before it"
    assert tools_problem([WEATHER_SCHEMA], "tools") is None
    assert tools_problem([{"type": "function", "function": {"name": 1}}], "tools") == \
        "tools[0].function.name must be a non-empty string, got number"


def test_sft_file_with_a_malformed_tool_record_names_its_line_or_skips_it(tmp_path, tokenizer):
    good = {"conversations": RENDERED["tool_results"][0]}
    turns, problem = MALFORMED["arguments_bad_json"]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [good, {"conversations": turns}, good]),
                    encoding="utf-8")
    with pytest.raises(DataFormatError) as error:
        SFTDataset(path, tokenizer)
    assert str(error.value) == f"{path}:2: {problem}"
    data = SFTDataset(path, tokenizer, skip_bad_lines=True)
    assert len(data) == 2 and data.report()["skipped_bad"] == 1
    assert data.report()["first_bad"] == [(2, problem)]
