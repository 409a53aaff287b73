"""Tool calls in a model's reply: which format the chat template teaches, and a reader that
splits the generated text into plain content and OpenAI `tool_calls`, whole or streamed.

Formats (picked from the markers the chat template's text contains):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number of
  them, with text around (Qwen2.5, Hermes, and templates written after them);
- llama3_json: the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2);
- mistral: the whole reply is `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
A call that does not parse stays text: the client sees what the model wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from keel.infer.serve.limits import ApiError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA3_MARKER = "<|python_tag|>"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, kw_only=True)
class ToolParsing:
    """How to read one request's replies: the template's format and the tools offered."""

    format: str  # "hermes" | "llama3_json" | "mistral"
    tool_names: frozenset[str]


def template_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches (None: none keel reads)."""
    if not template:
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARKER in template:
        return "mistral"
    if LLAMA3_MARKER in template or '"parameters"' in template:
        return "llama3_json"
    return None


def tool_parsing(request, template: str | None) -> ToolParsing | None:
    """How to read the replies to a chat request: None when it offers no tools (or
    tool_choice is "none": the prompt is rendered without them and replies are text).

    400 for what keel cannot honour: a tool_choice that forces a call (that takes
    constrained decoding), or tools for a chat template in no format keel reads.
    """
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools; send tools too", param="tool_choice")
        return None
    if choice == "none":
        return None
    if choice is not None and choice != "auto":
        raise ApiError(
            400,
            "tool_choice that forces a call ('required' or a named function) is not "
            "supported by keel serve: it needs constrained decoding; use 'auto' (the "
            "model decides) or 'none'",
            param="tool_choice",
        )
    kind = template_format(template)
    if kind is None:
        raise ApiError(
            400,
            "this model's chat template shows no tool-call format keel serve reads (Hermes/"
            "Qwen <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS]); send no tools",
            param="tools",
            code="tools_not_supported",
        )
    names = frozenset(tool.function.name for tool in tools)
    return ToolParsing(format=kind, tool_names=names)


def _call(obj, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from {"name": str, <argument key>: object or JSON text}; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes_block(body: str) -> list[ToolCall] | None:
    call = _call(_json(body.strip()), ("arguments", "parameters"))
    return None if call is None else [call]


def _whole_reply_calls(text: str, parsing: ToolParsing) -> list[ToolCall] | None:
    """The calls a llama3_json or mistral reply consists of, or None when it is text.

    keel's engine decodes without special tokens, so the marker may be absent; a call to a
    function the request did not offer is text (a JSON answer is not mistaken for a call).
    """
    body = text.strip()
    for marker in (MISTRAL_MARKER, LLAMA3_MARKER):
        body = body.removeprefix(marker).strip()
    parsed = _json(body)
    if parsing.format == "mistral" and isinstance(parsed, list) and parsed:
        calls = [_call(item, ("arguments", "parameters")) for item in parsed]
    elif parsing.format == "llama3_json":
        calls = [_call(parsed, ("parameters", "arguments"))]
    else:
        return None
    if any(c is None or c.name not in parsing.tool_names for c in calls):
        return None
    return calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could still grow into `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


Piece = str | ToolCall


class ToolCallReader:
    """Reads one choice's reply as it arrives: `feed` each new piece of text, `finish` at
    the end; each returns what can be released, text pieces and tool calls in order.

    Text that may still be (or become) a call is held back until it is decided, so the
    streamed pieces equal what reading the whole reply at once gives.
    """

    def __init__(self, parsing: ToolParsing):
        self.parsing = parsing
        self.buffer = ""
        self.inside = False  # hermes: within an opened <tool_call>
        self.decided_text = False  # whole-reply formats: the reply is plain text
        # hermes: whitespace after released text, held until text follows (it joins the
        # content) or a call does (it only separated the two, and is dropped).
        self.pending_space = ""
        self.calls = 0

    def feed(self, piece: str) -> list[Piece]:
        self.buffer += piece
        if self.parsing.format == "hermes":
            return self._spaced(self._hermes())
        return self._count(self._whole_reply(final=False))

    def finish(self) -> list[Piece]:
        """Release what is held: an unclosed call that parses is a call, else text."""
        if self.parsing.format != "hermes":
            return self._count(self._whole_reply(final=True))
        held, self.buffer = self.buffer, ""
        calls = _hermes_block(held[len(HERMES_OPEN) :]) if self.inside else None
        out = self._spaced(calls or ([held] if held else []))
        if not self.calls and self.pending_space:
            out.append(self.pending_space)
        return out

    def finish_reason(self, engine_reason: str) -> str:
        """The engine's reason, or "tool_calls" for a reply that ended on its own after calls."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def _count(self, pieces: list[Piece]) -> list[Piece]:
        self.calls += sum(isinstance(p, ToolCall) for p in pieces)
        return pieces

    def _spaced(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for piece in self._count(pieces):
            if isinstance(piece, ToolCall):
                self.pending_space = ""
                out.append(piece)
                continue
            text = self.pending_space + piece
            body = text.rstrip()
            self.pending_space = text[len(body) :]
            if body:
                out.append(body)
        return out

    def _hermes(self) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if not self.inside:
                start = self.buffer.find(HERMES_OPEN)
                end = start if start >= 0 else len(self.buffer)
                end -= 0 if start >= 0 else _partial_suffix(self.buffer, HERMES_OPEN)
                if end:
                    out.append(self.buffer[:end])
                self.buffer = self.buffer[end:]
                if start < 0:
                    return out
                self.inside = True
            close = self.buffer.find(HERMES_CLOSE, len(HERMES_OPEN))
            if close < 0:
                return out
            block = self.buffer[: close + len(HERMES_CLOSE)]
            self.buffer, self.inside = self.buffer[len(block) :], False
            calls = _hermes_block(block[len(HERMES_OPEN) : close])
            out.extend(calls if calls is not None else [block])

    def _whole_reply(self, *, final: bool) -> list[Piece]:
        if not self.decided_text:
            start = self.buffer.lstrip()
            could_be_call = (
                not start
                or start[0] in "{["
                or any(
                    marker.startswith(start[: len(marker)])
                    for marker in (MISTRAL_MARKER, LLAMA3_MARKER)
                )
            )
            if could_be_call and not final:
                return []
            calls = _whole_reply_calls(self.buffer, self.parsing) if could_be_call else None
            if calls:
                self.buffer = ""
                return calls
            self.decided_text = True
        held, self.buffer = self.buffer, ""
        return [held] if held else []


def split_reply(text: str, parsing: ToolParsing) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, tool calls); with calls, content is the text around them
    (stripped; None when there is none)."""
    reader = ToolCallReader(parsing)
    pieces = reader.feed(text) + reader.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    if calls:
        return content.strip() or None, calls
    return content, calls
