"""OpenAI request bodies (pydantic) and the response and stream-chunk objects keel answers with."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from keel.infer.serve.limits import ApiError
from keel.infer.serve.tool_calls import ToolCall, ToolParsing, split_reply
from keel.models.vision.family import PLACEHOLDER

# Strict: a number is a number (not "5" or true), a flag a JSON boolean; unknown fields are
# ignored as OpenAI does (the ones keel refuses are checked first: limits.refuse_unsupported).
_STRICT = ConfigDict(extra="ignore", strict=True)

# Sampling divides float32 logits by the temperature. Below 0.01 the result is greedy in
# all but name, and a small enough temperature overflows to inf and then NaN (1e-300 did);
# vLLM clamps at the same 0.01. 0 asks for greedy decoding itself.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0  # OpenAI's bound
# torch.Generator takes a signed or unsigned 64-bit seed.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Body(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _samplable(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {value:g} is too small to sample with; use 0 for greedy "
                f"decoding, or a temperature from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
            )
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _STRICT

    url: str  # data:image/...;base64,..., a file path or file:// URL (see serve/images.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; keel sends full images


class ImagePart(BaseModel):
    model_config = _STRICT

    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1)
    arguments: str  # JSON text of an object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value or "{}")
        except ValueError as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be the JSON text of an object")
        return value


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the history."""

    model_config = _STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def turn(self) -> dict:
        """As chat templates take it: arguments as a mapping (they render it with tojson)."""
        call = {"type": "function", "function": {"name": self.function.name}}
        call["function"]["arguments"] = json.loads(self.function.arguments or "{}")
        return call if self.id is None else {"id": self.id, **call}


class Message(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns only
    tool_call_id: str | None = None  # tool turns: the call this output answers
    name: str | None = None

    def text(self) -> str:
        """The content as text; each image part becomes the `<image>` placeholder."""
        if isinstance(self.content, list):
            return "".join(
                part.text if isinstance(part, TextPart) else PLACEHOLDER for part in self.content
            )
        return self.content or ""

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, URL) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [
            (index, part.image_url.url)
            for index, part in enumerate(self.content)
            if isinstance(part, ImagePart)
        ]


class FunctionDef(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema, handed to the chat template as is
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @field_validator("messages")
    @classmethod
    def _tool_fields_in_place(cls, messages: list[Message]) -> list[Message]:
        for i, m in enumerate(messages):
            if m.tool_calls and m.role != "assistant":
                raise ValueError(f"message {i}: only assistant messages carry tool_calls")
        return messages


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]


def parse(kind: type[_Body], body: dict) -> _Body:
    """Validate `body` as `kind`; the first problem becomes a 400 naming its field."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise ApiError(400, f"{param}: {error['msg']}", param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Reply:
    """Builds the objects of one response: chat or text completion, whole or streamed."""

    def __init__(self, *, chat: bool, model: str, tools: ToolParsing | None = None):
        self.chat = chat
        self.model = model
        self.tools = tools  # a chat request that offered tools: replies are read for calls
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _object(self, *, chunk: bool) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, texts: list[str], reasons: list[str], usage: dict) -> dict:
        """The non-streamed response with every choice."""
        choices = []
        for index, (text, reason) in enumerate(zip(texts, reasons)):
            choice = {"index": index, "finish_reason": reason, "logprobs": None}
            if self.chat:
                choice["message"] = self._message(text)
                if choice["message"].get("tool_calls") and reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._object(chunk=False), "choices": choices, "usage": usage}

    def _message(self, text: str) -> dict:
        if self.tools is None:
            return {"role": "assistant", "content": text}
        content, calls = split_reply(text, self.tools)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message

    def tool_call_chunk(self, index: int, call: ToolCall, position: int) -> dict:
        """A stream chunk carrying one whole tool call, the `position`-th of its choice."""
        chunk = self.chunk(index)
        delta = {"index": position, **call.openai()}
        chunk["choices"][0]["delta"] = {"tool_calls": [delta]}
        return chunk

    def chunk(self, index: int, *, text: str | None = None, reason: str | None = None) -> dict:
        """One stream chunk: new text of choice `index`, or its finish reason."""
        choice: dict = {"index": index, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {"content": text} if text is not None else {}
        else:
            choice["text"] = text or ""
        return {**self._object(chunk=True), "choices": [choice]}

    def role_chunk(self, index: int) -> dict:
        """A chat stream starts each choice by naming the speaker."""
        chunk = self.chunk(index)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return chunk

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._object(chunk=True), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
