"""OpenAI request bodies (pydantic) and the response and stream-chunk objects keel answers with."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from keel.infer.serve.limits import ApiError


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    # Unknown fields are ignored as OpenAI does; the ones keel refuses are checked first
    # (limits.refuse_unsupported).
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)


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

    def __init__(self, *, chat: bool, model: str):
        self.chat = chat
        self.model = model
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
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._object(chunk=False), "choices": choices, "usage": usage}

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
