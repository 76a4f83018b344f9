"""Chat messages, as SFT records and chat requests carry them: checked, and made ready for CHAT_TEMPLATE.

Accepted turns (the shapes minimind, OpenAI and Qwen use):

    {"role": "system", "content": str, "tools" (or "functions"): [schema, ...] or a JSON string of that list}
        tools only on the first turn; a schema is {"type": "function", "function": {"name", ...}} or {"name", ...}
    {"role": "user", "content": str}
    {"role": "assistant", "content": str, "reasoning_content": str (optional),
     "tool_calls": [{"id": str (optional), "type": "function", "function": {"name": str, "arguments": args}}]}
        args is an object or a JSON string of one; a call may also be flat ({"name", "arguments"});
        with tool_calls, content may be "", null or absent
    {"role": "tool", "content": str (the result), "tool_call_id": str (optional), "name": str (optional)}
        right after the assistant turn whose call it answers, or after another result of the same turn

CHAT_TEMPLATE renders them as minimind's chat template does:

    tools      "<|im_start|>system\\n{system content}\\n\\n# Tools ... <tools>\\n{schema}\\n...</tools> ...<|im_end|>\\n"
    assistant  "<|im_start|>assistant\\n" + "<think>\\n{reasoning}\\n</think>\\n\\n" (only when there is reasoning)
               + content + "<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>" per call (joined by "\\n")
               + "<|im_end|>\\n"
    tool       consecutive results share one user turn:
               "<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>...<|im_end|>\\n"

and every other turn as "<|im_start|>{role}\\n{content}<|im_end|>\\n", so plain system/user/assistant
conversations render exactly as before (unlike minimind, no empty think block is written).
So everything the assistant writes lies between "<|im_start|>assistant\\n" and its "<|im_end|>",
and tool results, like system and user text, lie outside.
"""
import json

ROLES = ("system", "user", "assistant", "tool")
TOOLS_FIELDS = ("tools", "functions")  # "functions": minimind's older name for the same list
ASSISTANT_FIELDS = ("tool_calls", "reasoning_content")

TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_POSTAMBLE = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def jinja_string(text: str) -> str:
    """text as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# Reads what template_messages writes; also takes tools from apply_chat_template(..., tools=[...]).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(tools=tools) -%}"
    "{%- if not ns.tools and messages and messages[0].role == 'system' and messages[0].tools -%}"
    "{%- set ns.tools = messages[0].tools -%}"
    "{%- endif -%}"
    "{%- if ns.tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' and messages[0].content -%}"
    "{{- messages[0].content + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- " + jinja_string(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in ns.tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}"
    "{{- " + jinja_string(TOOLS_POSTAMBLE) + " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif not (loop.first and ns.tools and message.role == 'system') -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'assistant' and message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set function = call.function if call.function else call -%}"
    "{%- set arguments = function.arguments if function.arguments is string else function.arguments | tojson -%}"
    "{{- '<tool_call>\\n{\"name\": ' + function.name | tojson + ', \"arguments\": ' + arguments + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parsed_json(value, where: str):
    """(value, None) for a non-string; a JSON string -> (its parsed value, None) or (None, problem)."""
    if not isinstance(value, str):
        return value, None
    try:
        return json.loads(value), None
    except json.JSONDecodeError as error:
        return None, f"{where} is not valid JSON: {error.msg} (column {error.pos + 1})"


def name_problem(holder: dict, where: str):
    """None if holder["name"] is a non-empty string, else what is wrong with it."""
    if "name" not in holder:
        return f"{where} is missing field 'name'"
    if not isinstance(holder["name"], str) or not holder["name"]:
        return f"{where}.name must be a non-empty string, got {json_type(holder['name'])}"
    return None


def tools_problem(tools, where: str):
    """None if tools is a list of function schemas (or a JSON string of one), else what is wrong with it."""
    tools, problem = parsed_json(tools, where)
    if problem:
        return problem
    if not isinstance(tools, list):
        return f"{where} must be an array of function schemas, got {json_type(tools)}"
    for k, tool in enumerate(tools):
        at = f"{where}[{k}]"
        if not isinstance(tool, dict):
            return f"{at} must be an object, got {json_type(tool)}"
        if "function" in tool:
            if not isinstance(tool["function"], dict):
                return f"{at}.function must be an object, got {json_type(tool['function'])}"
            tool, at = tool["function"], f"{at}.function"
        if problem := name_problem(tool, at):
            return problem
    return None


def tool_call_problem(call, where: str):
    """None if call is one usable tool call (OpenAI or flat shape), else what is wrong with it."""
    if not isinstance(call, dict):
        return f"{where} must be an object, got {json_type(call)}"
    if "type" in call and call["type"] != "function":
        return f"{where}.type {call['type']!r} is unknown (expected 'function')"
    if "id" in call and not isinstance(call["id"], str):
        return f"{where}.id must be a string, got {json_type(call['id'])}"
    if "function" in call:
        if not isinstance(call["function"], dict):
            return f"{where}.function must be an object, got {json_type(call['function'])}"
        call, where = call["function"], f"{where}.function"
    if problem := name_problem(call, where):
        return problem
    if "arguments" not in call:
        return f"{where} is missing field 'arguments'"
    arguments, problem = parsed_json(call["arguments"], f"{where}.arguments")
    if problem:
        return problem
    if not isinstance(arguments, dict):
        return f"{where}.arguments must be an object or a JSON string of one, got {json_type(arguments)}"
    return None


def turn_problem(turn, where: str, first: bool):
    """None if turn is one usable message on its own (its place in the conversation aside), else what is wrong."""
    if not isinstance(turn, dict):
        return f"{where} must be an object, got {json_type(turn)}"
    if "role" not in turn:
        return f"{where} is missing field 'role'"
    role = turn["role"]
    if not isinstance(role, str):
        return f"{where}.role must be a string, got {json_type(role)}"
    if role not in ROLES:
        return f"{where}.role {role!r} is unknown (expected one of: {', '.join(ROLES)})"
    calls = turn.get("tool_calls")
    content_optional = role == "assistant" and bool(calls)  # a tool call needs no text beside it
    if not (content_optional and turn.get("content") is None):
        if "content" not in turn:
            return f"{where} is missing field 'content'"
        if not isinstance(turn["content"], str):
            return f"{where}.content must be a string, got {json_type(turn['content'])}"
    tools_fields = [field for field in TOOLS_FIELDS if turn.get(field) is not None]
    if tools_fields and not (first and role == "system"):
        return f"{where}.{tools_fields[0]} is only allowed on the first turn, a system turn"
    if len(tools_fields) > 1:
        return f"{where} has both 'tools' and 'functions' (give one list)"
    for field in tools_fields:
        if problem := tools_problem(turn[field], f"{where}.{field}"):
            return problem
    for field in ASSISTANT_FIELDS:
        if turn.get(field) is not None and role != "assistant":
            return f"{where}.{field} is only allowed on assistant turns (this one is {role!r})"
    if turn.get("reasoning_content") is not None and not isinstance(turn["reasoning_content"], str):
        return f"{where}.reasoning_content must be a string, got {json_type(turn['reasoning_content'])}"
    if calls is not None:
        if not isinstance(calls, list):
            return f"{where}.tool_calls must be an array, got {json_type(calls)}"
        for j, call in enumerate(calls):
            if problem := tool_call_problem(call, f"{where}.tool_calls[{j}]"):
                return problem
    if role == "tool":
        for field in ("tool_call_id", "name"):
            if turn.get(field) is not None and not isinstance(turn[field], str):
                return f"{where}.{field} must be a string, got {json_type(turn[field])}"
    return None


def conversation_problem(turns, name: str = "conversations"):
    """None if turns (a list of messages, see the module docstring) is usable, else what is wrong with it:
    one line naming the field, e.g. "conversations[2].tool_calls[0].function is missing field 'name'".
    name is what the messages are called in the messages ("conversations" in SFT records)."""
    if not isinstance(turns, list):
        return f"field '{name}' must be an array, got {json_type(turns)}"
    if not turns:
        return f"field '{name}' is an empty array"
    caller = None  # (where, call ids) of the assistant turn whose results may come next
    results = 0  # results since that turn
    for i, turn in enumerate(turns):
        where = f"{name}[{i}]"
        if problem := turn_problem(turn, where, first=i == 0):
            return problem
        if turn["role"] != "tool":
            calls = turn.get("tool_calls") if turn["role"] == "assistant" else None
            caller = (where, [call.get("id") for call in calls]) if calls else None
            results = 0
            continue
        if caller is None:
            return f"{where} is a tool result, but no assistant turn with tool_calls comes right before it"
        caller_where, call_ids = caller
        results += 1
        if results > len(call_ids):
            return f"{where} is tool result {results} of {caller_where}, which made {len(call_ids)} tool call(s)"
        known_ids = [call_id for call_id in call_ids if call_id is not None]
        call_id = turn.get("tool_call_id")
        if call_id is not None and known_ids and call_id not in known_ids:
            return (f"{where}.tool_call_id {call_id!r} matches no call of {caller_where} "
                    f"(ids: {', '.join(known_ids)})")
    return None


def template_call(call: dict) -> dict:
    """One valid tool call -> {"type": "function", "function": {"name", "arguments"}} (+ "id" when given)."""
    function = call.get("function", call)
    wrapped = {"type": "function", "function": {"name": function["name"], "arguments": function["arguments"]}}
    return {"id": call["id"], **wrapped} if "id" in call else wrapped


def template_messages(turns: list) -> list:
    """Valid turns (conversation_problem(turns) is None) -> new message dicts in the one shape CHAT_TEMPLATE reads:
    tools parsed from a JSON string and kept under "tools", tool calls in the OpenAI shape, assistant content a
    string, reasoning without the newlines around it (and left out when that leaves nothing)."""
    messages = []
    for turn in turns:
        message = {key: value for key, value in turn.items() if key not in TOOLS_FIELDS + ASSISTANT_FIELDS}
        tools = next((turn[field] for field in TOOLS_FIELDS if turn.get(field) is not None), None)
        if tools is not None:
            message["tools"] = json.loads(tools) if isinstance(tools, str) else tools
        if turn["role"] == "assistant":
            message["content"] = turn.get("content") or ""
            reasoning = (turn.get("reasoning_content") or "").strip("\n")
            if reasoning:
                message["reasoning_content"] = reasoning
            if turn.get("tool_calls"):
                message["tool_calls"] = [template_call(call) for call in turn["tool_calls"]]
        messages.append(message)
    return messages
