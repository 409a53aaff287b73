"""The HTTP routes: OpenAI chat/completions, models, vLLM-style adapter loading, health, web chat."""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from keel.errors import KeelError
from keel.infer.serve import streams
from keel.infer.serve.adapter_files import within_root
from keel.infer.serve.chat_images import (
    chat_prompt_with_images,
    chat_turns,
    has_placeholder,
    image_refs,
)
from keel.infer.serve.limits import (
    CHAT_TOOL_FIELDS,
    ApiError,
    ServeLimits,
    Slots,
    model_not_found,
    refuse_unsupported,
    sampling_params,
)
from keel.infer.serve.protocol import ChatRequest, CompletionRequest, Reply, parse
from keel.infer.serve.tool_calls import tool_parsing


@dataclass(kw_only=True)
class ServeState:
    """What the routes share: the engine (any backend with its interface), the tokenizer
    that turns requests into token ids, the limits, the optional API key, the folder
    clients may load adapters from (None: adapters are managed at startup only), and for a
    vision-language model its image processing (keel.models.vision.VisionProcessing) and
    the folder request image paths may point into (None: data: URLs only)."""

    engine: object
    tokenizer: object
    limits: ServeLimits
    default_model: str
    api_key: str | None = None
    adapter_root: Path | None = None
    vision: object | None = None
    image_root: Path | None = None
    slots: Slots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = Slots(self.limits.max_concurrency)

    @property
    def body_bytes(self) -> int:
        return self.limits.body_bytes(images=self.vision is not None)


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine's scheduler thread."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="keel serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_completion_routes(app, state)
    _add_adapter_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else None
        error = ApiError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error.body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return JSONResponse(ApiError(400, str(exc)).body, status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        print(f"keel serve: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        error = ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")
        return JSONResponse(error.body, status_code=500)


def _add_info_routes(app: FastAPI, state: ServeState) -> None:
    """The web chat page, /health and the OpenAI model list."""

    @app.get("/", response_class=HTMLResponse)
    async def web_chat():
        page = resources.files("keel.infer.serve").joinpath("web/index.html")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        stats = state.engine.stats
        return {
            "status": "ok",
            "requests_in_flight": state.slots.used,
            "running_sequences": stats.running,
            "waiting_requests": stats.waiting,
            "decode_steps": stats.steps,
            "generated_tokens": stats.generated_tokens,
        }

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, state)
        created = int(time.time())
        names = state.engine.adapters.names()
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "keel",
                "root": name,
                "parent": None if name == names[0] else names[0],
            }
            for name in names
        ]
        return {"object": "list", "data": data}


def _add_completion_routes(app: FastAPI, state: ServeState) -> None:
    """OpenAI's chat and text completions (both through `_complete`)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, state, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, state, chat=False)


def _add_adapter_routes(app: FastAPI, state: ServeState) -> None:
    """vLLM-style runtime adapter loading and unloading, within the adapter root."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        _authorize(request, state)
        root = _adapter_root(state)
        body = await _json_body(request, state.body_bytes)
        name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
        try:
            directory = within_root(root, path)
        except KeelError as e:
            raise ApiError(403, str(e), param="lora_path", code="outside_adapter_root") from None
        await _engine_call(state.engine.load_adapter(name, str(directory)))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        _authorize(request, state)
        _adapter_root(state)
        body = await _json_body(request, state.body_bytes)
        name = _string_field(body, "lora_name")
        names = state.engine.adapters.names()
        if name not in names[1:]:
            raise ApiError(
                404,
                f"no adapter named {name!r} is loaded; adapters: {', '.join(names[1:]) or '(none)'}",
                param="lora_name",
                code="model_not_found",
            )
        await _engine_call(state.engine.unload_adapter(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _complete(request: Request, state: ServeState, *, chat: bool):
    """Both completion routes: check the request, then answer it whole or streamed."""
    _authorize(request, state)
    body = await _json_body(request, state.body_bytes)
    refuse_unsupported(body, accepted=CHAT_TOOL_FIELDS if chat else ())
    req = parse(ChatRequest if chat else CompletionRequest, body)
    model = _served_model(req.model, state)
    job = {"model": model, "n": req.n}
    tools = None
    if chat:
        tools = tool_parsing(req, getattr(state.tokenizer, "chat_template", None))
        images = image_refs(req.messages, state)
        if images or has_placeholder(req.messages, state):
            if tools is not None:
                raise ApiError(400, "keel serve takes tools or images, not both", param="tools")
            prompt = await asyncio.to_thread(chat_prompt_with_images, state, req.messages, images)
            prompts, job["images"] = [prompt.input_ids], prompt
        else:
            offered = [t.model_dump(exclude_none=True) for t in req.tools] if tools else None
            prompts = [_encode_chat(state.tokenizer, req.messages, offered)]
    else:
        prompts = _encode_prompts(state.tokenizer, req.prompt, state.limits.max_prompts)
    reply = Reply(chat=chat, model=model, tools=tools)
    return await _answer(request, state, req, prompts, job=job, reply=reply)


async def _answer(request: Request, state: ServeState, req, prompts, *, job: dict, reply: Reply):
    chat = reply.chat
    prompt_field = "messages" if chat else "prompt"
    if min(len(ids) for ids in prompts) == 0:
        raise ApiError(400, "the prompt is empty", param=prompt_field)
    params = sampling_params(
        req,
        prompt_tokens=max(len(ids) for ids in prompts),
        limits=state.limits,
        context_length=state.engine.context_length,
        prompt_field=prompt_field,
    )
    state.slots.acquire()
    run = streams.Run(state.engine, prompts, params, state.slots.release, **job)
    run.start()
    if req.stream:
        events = streams.stream(run, reply, include_usage=req.include_usage)
        return _StreamResponse(events, run)
    try:
        return await streams.whole(run, reply, request.is_disconnected)
    except streams.ClientGone:
        return JSONResponse(ApiError(499, "client closed the request").body, status_code=499)
    finally:
        run.close()


class _StreamResponse(EventSourceResponse):
    """SSE that closes its run however the response ends: finished, failed, or cancelled
    because the client disconnected (the sequences leave the batch, the slot is freed)."""

    def __init__(self, events, run: streams.Run):
        super().__init__(events, sep="\n")
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def _authorize(request: Request, state: ServeState) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), state.api_key.encode()
    ):
        raise ApiError(
            401,
            "missing or incorrect API key; send the header Authorization: Bearer <key>",
            code="invalid_api_key",
        )


async def _json_body(request: Request, limit: int) -> dict:
    too_large = ApiError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > limit:
            raise too_large
    try:
        body = json.loads(raw, parse_constant=_not_json)
        # A "\ud800" escape decodes to a lone surrogate, which no tokenizer or reply takes.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def _adapter_root(state: ServeState) -> Path:
    if state.adapter_root is None:
        raise ApiError(
            403,
            "loading and unloading adapters over the API is off on this server; start "
            "keel serve with --adapter-root DIR to allow adapters from inside DIR",
            code="adapter_api_disabled",
            kind="permission_error",
        )
    return state.adapter_root


def _served_model(name: str | None, state: ServeState) -> str:
    served = state.engine.adapters.names()
    if name is None:
        return state.default_model
    if name not in served:
        raise model_not_found(name, served)
    return name


def _string_field(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{key} must be a non-empty string", param=key)
    return value


def _encode_chat(tokenizer, messages, tools: list[dict] | None) -> list[int]:
    """The conversation as the chat template renders it, with the offered tools (None:
    rendered as without tools, as for a request that offered none)."""
    from jinja2 import TemplateError

    turns = chat_turns(tokenizer, messages)
    with_tools = {"tools": tools} if tools else {}
    try:
        encoded = tokenizer.apply_chat_template(
            turns, add_generation_prompt=True, tokenize=True, return_dict=True, **with_tools
        )
    except (TemplateError, ValueError, TypeError) as e:
        raise ApiError(
            400, f"the chat template refused these messages: {e}", param="messages"
        ) from None
    return list(encoded["input_ids"])


def _encode_prompts(tokenizer, prompt, max_prompts: int) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not 1 <= len(prompt) <= max_prompts:
        raise ApiError(
            400, f"prompt must hold 1 to {max_prompts} prompts (--max-prompts)", param="prompt"
        )
    encoded = []
    for item in prompt:
        if isinstance(item, str):
            encoded.append(tokenizer.encode(item))
            continue
        bad = [t for t in item if not 0 <= t < len(tokenizer)]
        if bad:
            raise ApiError(
                400, f"prompt: token id {bad[0]} is outside the vocabulary", param="prompt"
            )
        encoded.append(list(item))
    return encoded


async def _engine_call(future) -> None:
    try:
        await asyncio.wrap_future(future)
    except KeelError as e:
        raise ApiError(400, str(e)) from None
