"""Tool-calling rows: tool definitions, the assistant's tool calls and the tools' outputs.

A row is rendered with the chat template's own tool support, as transformers' tool-use API
does: `apply_chat_template(messages, tools=tools)`, with

- tools: JSON schemas `{"type": "function", "function": {name, description, parameters}}`;
  a bare `{name, description, parameters}` (LLaMA-Factory's glaive rows) is wrapped so
- an assistant's calls: `tool_calls: [{"type": "function", "function": {name, arguments}}]`,
  arguments a dict (OpenAI's JSON-string arguments are parsed), content "" when it has none
- a tool's output: `{"role": "tool", "content": ...}` (OpenAI's `name`/`tool_call_id` kept)

Formats read (column and tag names as in keel.data.formats; `tools` column: a list or a
JSON string of one):

- LLaMA-Factory sharegpt: a `function_call` message (function_tag) holds a JSON call
  `{"name", "arguments"}` or a list of them and becomes an assistant turn with those calls;
  an `observation` message (observation_tag) becomes a tool output
- OpenAI messages: assistant messages with `tool_calls`, `tool` messages (TRL's tool format
  is the same with dict arguments)

Trained: the assistant's answers and calls (keel.data.template's assistant spans: a call
turn's span ends at its EOS); never the tools' outputs, which are input like user turns.
Rows without tool definitions or tool turns go through `row_to_example` unchanged.
"""

from __future__ import annotations

import json

from keel.data.formats import (
    Example,
    FormatSpec,
    RowError,
    parse_message,
    refuse_unsupported,
    row_images,
    row_to_example,
    with_system,
)
from keel.data.template import ChatTemplate
from keel.errors import DataError

_EMPTY = (None, "", "[]", [])


def read_example(row: dict, spec: FormatSpec) -> Example:
    """`row_to_example`, and for sharegpt/messages rows with tools or tool turns the
    conversation with its tool calls and outputs and `Example.tools`. Raises RowError."""
    if not has_tool_content(row, spec):
        return row_to_example(row, spec)
    c, t = spec.columns, spec.tags
    if spec.format not in ("sharegpt", "messages"):
        raise RowError(
            f"has tool definitions (column '{c['tools']}'); tool-calling rows are "
            f"conversations: use the sharegpt or messages format"
        )
    refuse_unsupported(row, {**c, "tools": None})  # videos and audios
    col = c["messages"]
    conversation = row.get(col)
    if not isinstance(conversation, list):
        raise RowError(f"field '{col}' must be a list of messages")
    inline: list = []
    messages = [_parse_turn(m, i, col, t, inline) for i, m in enumerate(conversation, 1)]
    messages = with_system(messages, row, c)
    validate_tool_conversation(messages)
    tools = parse_tools(row.get(c.get("tools")) if c.get("tools") else None, c.get("tools"))
    texts = [m["content"] for m in messages]
    return Example(messages, row_images(row, c, texts, inline), tools)


def has_tool_content(row: dict, spec: FormatSpec) -> bool:
    """Whether the row holds tool definitions, tool calls or tool outputs."""
    col = spec.columns.get("tools")
    if col and row.get(col) not in _EMPTY:
        return True
    t, messages_col = spec.tags, spec.columns.get("messages")
    if not t or not messages_col:  # not a conversation format
        return False
    tool_roles = {t["observation_tag"], t["function_tag"]} - {None}
    conversation = row.get(messages_col)
    return isinstance(conversation, list) and any(
        isinstance(m, dict) and (m.get(t["role_tag"]) in tool_roles or m.get("tool_calls"))
        for m in conversation
    )


def _parse_turn(m, i: int, col: str, t: dict, inline: list) -> dict:
    """One message as transformers' tool-use API expects it."""
    role = m.get(t["role_tag"]) if isinstance(m, dict) else None
    if role is not None and role == t["function_tag"]:
        calls = _calls_from_json(m.get(t["content_tag"]), f"message {i} of '{col}'")
        return {"role": "assistant", "content": "", "tool_calls": calls}
    if role is not None and role == t["observation_tag"]:
        output = {"role": "tool", "content": _tool_output(m.get(t["content_tag"]), i, col)}
        return output | {k: m[k] for k in ("name", "tool_call_id") if m.get(k)}
    if not (isinstance(m, dict) and m.get("tool_calls")):
        return parse_message(m, i, col, t, inline)
    if role != t["assistant_tag"]:
        raise RowError(f"message {i} of '{col}': only assistant messages have tool_calls")
    parsed = parse_message({**m, "tool_calls": None}, i, col, t, inline)
    return parsed | {"tool_calls": _openai_calls(m["tool_calls"], f"message {i} of '{col}'")}


def _tool_output(content, i: int, col: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, dict | list):  # a structured result: the template shows its JSON
        return json.dumps(content, ensure_ascii=False)
    raise RowError(f"message {i} of '{col}': a tool output must be text or JSON")


def _calls_from_json(content, where: str) -> list[dict]:
    """LLaMA-Factory's function_call content: one JSON call {name, arguments} or a list."""
    try:
        value = json.loads(content) if isinstance(content, str) else content
    except json.JSONDecodeError as e:
        raise RowError(f"{where}: the function call is not JSON ({e.msg})") from None
    calls = value if isinstance(value, list) else [value]
    return [_call(call, where) for call in calls]


def _openai_calls(tool_calls, where: str) -> list[dict]:
    """OpenAI/TRL tool_calls: [{"type": "function", "function": {name, arguments}, "id"?}]."""
    if not isinstance(tool_calls, list):
        raise RowError(f"{where}: tool_calls must be a list")
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if function is None:
            raise RowError(f'{where}: each tool call needs {{"type": "function", "function": ...}}')
        calls.append(_call(function, where) | ({"id": call["id"]} if call.get("id") else {}))
    return calls


def _call(call, where: str) -> dict:
    """{"type": "function", "function": {"name", "arguments": dict}} from {name, arguments}."""
    name = call.get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or not name:
        raise RowError(f'{where}: a tool call needs {{"name": ..., "arguments": {{...}}}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: the arguments of '{name}' are not JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
        raise RowError(f"{where}: the arguments of '{name}' must be a JSON object")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tools(value, col: str | None) -> tuple[dict, ...]:
    """The tool definitions of column `col` (a list, or a JSON string of one), each as
    {"type": "function", "function": {...}}. RowError when malformed."""
    if value in _EMPTY:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"field '{col}': the tool definitions are not JSON ({e.msg})") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise RowError(f"field '{col}' must be a list of tool definitions (JSON objects)")
    return tuple(_schema(_without_nulls(tool), col) for tool in value)


def _schema(tool: dict, col: str | None) -> dict:
    function = tool.get("function") if tool.get("type", "function") == "function" else None
    if isinstance(function, dict) and function.get("name"):
        return tool
    if tool.get("name"):  # a bare function description (glaive, LLaMA-Factory)
        return {"type": "function", "function": tool}
    raise RowError(f"field '{col}': a tool definition needs a name (got keys {sorted(tool)})")


def _without_nulls(value):
    """A JSON value without null fields: a list of tools read as one Arrow column gains every
    tool's keys, null where a tool does not have them; no schema key means null."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def validate_tool_conversation(messages: list[dict]) -> None:
    """Optional system, then a user turn; each assistant turn answers a user turn or tool
    outputs; tool outputs follow an assistant turn with tool calls (one output or more); a
    conversation ends with an assistant turn (an answer or calls)."""
    offset = 1 if messages[:1] and messages[0]["role"] == "system" else 0
    previous = "system"
    for pos, m in enumerate(messages[offset:], offset + 1):
        role = m["role"]
        allowed = _NEXT[previous]
        if role not in allowed:
            raise RowError(
                f"wrong role order: message {pos} is {role}, expected {' or '.join(allowed)} "
                f"(tool outputs follow an assistant turn with tool calls)"
            )
        if role == "assistant" and not m.get("tool_calls") and not m["content"].strip():
            raise RowError(f"empty answer (message {pos})")
        if role == "user" and not m["content"].strip():
            raise RowError(f"empty user message (message {pos})")
        previous = "calls" if m.get("tool_calls") else role
    if previous not in ("assistant", "calls"):
        raise RowError(f"wrong role order: the conversation ends with {previous}")


# what may follow each kind of turn ("calls": an assistant turn with tool calls)
_NEXT = {
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user",),
    "calls": ("tool",),
    "tool": ("tool", "assistant"),
}


def check_tool_template(template: ChatTemplate) -> None:
    """DataError unless the chat template renders tools (its text uses `tools`)."""
    if "tools" not in template.text:
        shown = {"tokenizer": "the model's own chat template", "chatml": "keel's builtin chatml"}
        raise DataError(
            f"data.template: {shown.get(template.name, template.name)} ({template.name}) "
            f"does not render tools, so tool-calling rows cannot be trained with it; use a "
            f"model whose chat template supports tools (e.g. Qwen2.5-Instruct, Llama-3.1-"
            f"Instruct) or set data.template to a .jinja template that renders `tools`"
        )
