"""Request limits and OpenAI-style errors: bad input is a 4xx with a message, never a 500."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from keel.infer.serve.adapter_files import AdapterCaps
from keel.infer.serve.sampling import SamplingParams

# OpenAI's own bounds; a stop list longer than 4 is refused there too.
MAX_STOP_STRINGS = 4
# Each generated token is checked against every stop string's possible starts, so their
# length is bounded too.
MAX_STOP_LENGTH = 512
# Parameters keel does not implement: refused when set to anything but their neutral value,
# so a client never silently gets something other than what it asked for.
_NEUTRAL = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


@dataclass(frozen=True, kw_only=True)
class ServeLimits:
    """What one request may ask for, and how much the server takes on at once."""

    max_batch_size: int = 16  # sequences decoded together
    max_concurrency: int = 64  # requests in flight (running + queued); more get 429
    max_tokens: int = 2048  # cap on a request's max_tokens
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_prompts: int = 16  # prompts in one /v1/completions request
    max_prompt_tokens: int = 8192  # tokens in one prompt (the model's context may be less)
    # Prompt tokens prefilled per scheduler step; a longer prompt is prefilled in chunks
    # between decode steps, so it cannot hold up the sequences already running.
    max_prefill_tokens: int = 512
    max_adapters: int = 8  # LoRA adapters served at once (startup ones included)
    max_lora_rank: int = 256
    max_adapter_bytes: int = 1 << 30  # adapter_model.safetensors
    # Images in one chat request (vision-language models only), each at most this many
    # bytes (encoded) and pixels.
    max_images: int = 4
    max_image_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096

    def problems(self) -> list[str]:
        """Every flag value that cannot work, each naming its flag."""
        found = []
        for flag, value in (
            ("--max-batch-size", self.max_batch_size),
            ("--max-concurrency", self.max_concurrency),
            ("--max-tokens", self.max_tokens),
            ("--max-prompts", self.max_prompts),
            ("--max-prompt-tokens", self.max_prompt_tokens),
            ("--max-prefill-tokens", self.max_prefill_tokens),
            ("--max-adapters", self.max_adapters),
            ("--max-lora-rank", self.max_lora_rank),
            ("--max-adapter-size", self.max_adapter_bytes),
            ("--max-images", self.max_images),
            ("--max-image-size", self.max_image_bytes),
            ("--max-image-pixels", self.max_image_pixels),
        ):
            if value < 1:
                found.append(f"{flag} {value}: must be at least 1")
        return found

    def body_bytes(self, *, images: bool) -> int:
        """The largest request body: with images, room for --max-images inline images
        (base64: 4 characters per 3 bytes) on top of --max-body-bytes."""
        if not images:
            return self.max_body_bytes
        return self.max_body_bytes + self.max_images * (self.max_image_bytes * 4 // 3 + 64)

    def adapter_caps(self) -> AdapterCaps:
        return AdapterCaps(
            max_adapters=self.max_adapters,
            max_rank=self.max_lora_rank,
            max_bytes=self.max_adapter_bytes,
        )


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(name: str, served: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model {name!r} does not exist here; served models: {', '.join(served)}",
        param="model",
        code="model_not_found",
    )


# Chat requests may offer tools (checked by tool_calls.tool_parsing); text completions may not.
CHAT_TOOL_FIELDS = ("tools", "tool_choice")


def refuse_unsupported(body: dict, accepted: tuple[str, ...] = ()) -> None:
    """400 for the first parameter set that keel serve does not implement (`accepted`:
    fields this route implements after all)."""
    for key, neutral in _NEUTRAL.items():
        if key in body and key not in accepted and body[key] not in neutral:
            raise ApiError(400, f"{key} is not supported by keel serve; leave it out", param=key)


def sampling_params(
    request, *, prompt_tokens: int, limits: ServeLimits, context_length: int, prompt_field: str
) -> SamplingParams:
    """Check a parsed request's sampling fields against the limits; 400 names the field
    (`prompt_field` for a prompt that is too long: "messages" or "prompt").

    A request without max_tokens may fill the context, up to --max-tokens.
    """
    _check_prompt_length(prompt_tokens, limits, context_length, prompt_field)
    max_tokens = _max_tokens(request, prompt_tokens, limits, context_length)
    largest_n = min(limits.max_n, limits.max_batch_size)
    if not 1 <= request.n <= largest_n:
        raise ApiError(400, f"n {request.n} must be between 1 and {largest_n}", param="n")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=_stop_strings(request.stop),
        seed=request.seed,
    )


def _check_prompt_length(
    prompt_tokens: int, limits: ServeLimits, context_length: int, prompt_field: str
) -> None:
    """400 for a prompt over --max-prompt-tokens, or one that leaves no room for a reply."""
    if prompt_tokens > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; this server takes at most "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens)",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if prompt_tokens >= context_length:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; this model's context is "
            f"{context_length} tokens, which leaves no room for a reply",
            param=prompt_field,
            code="context_length_exceeded",
        )


def _max_tokens(request, prompt_tokens: int, limits: ServeLimits, context_length: int) -> int:
    """max_completion_tokens, else max_tokens, else what the context leaves (up to
    --max-tokens); 400 when it is out of range or does not fit after the prompt."""
    room = context_length - prompt_tokens
    asked = request.max_completion_tokens
    asked = request.max_tokens if asked is None else asked
    max_tokens = min(limits.max_tokens, room) if asked is None else asked
    if max_tokens < 1 or max_tokens > limits.max_tokens:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} must be between 1 and {limits.max_tokens} on this server",
            param="max_tokens",
        )
    if max_tokens > room:
        raise ApiError(
            400,
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds this model's "
            f"context of {context_length} tokens; lower max_tokens to at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _stop_strings(stop) -> tuple[str, ...]:
    """The request's stop (None, a string or a list) as a tuple; 400 past the limits."""
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_LENGTH for s in stop):
        raise ApiError(
            400,
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_LENGTH} characters",
            param="stop",
        )
    return stop


class Slots:
    """Counts requests in flight; one more than `limit` gets a 429."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            if self.used >= self.limit:
                raise ApiError(
                    429,
                    f"the server is at its limit of {self.limit} requests in flight; retry shortly",
                    code="rate_limit_exceeded",
                    kind="rate_limit_error",
                )
            self.used += 1

    def release(self) -> None:
        with self._lock:
            self.used -= 1
