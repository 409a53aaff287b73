"""OpenAI request bodies (pydantic) and the response and stream-chunk objects keel answers with."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from keel.infer.serve.limits import ApiError
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


class Message(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None

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
