"""Carry one HTTP request's jobs through the engine: a streamed (SSE) or a whole response."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from keel.infer.serve.limits import ApiError
from keel.infer.serve.protocol import Reply, usage
from keel.infer.serve.sampling import SamplingParams
from keel.infer.serve.scheduler import Delta, Done, Event, Failed, Job
from keel.infer.serve.tool_calls import ToolCall, ToolCallReader

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


class Run:
    """One request's jobs (one per prompt, `n` choices each) and their events, in order."""

    def __init__(
        self,
        engine,
        prompts: list[list[int]],
        params: SamplingParams,
        on_close: Callable[[], None],
        **job,
    ):
        self.engine = engine
        self.on_close = on_close
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        n = job["n"]
        self.jobs = [
            Job(prompt_ids=ids, params=params, sink=self._sink, first_index=i * n, **job)
            for i, ids in enumerate(prompts)
        ]
        self.choices = len(prompts) * n
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.completion_tokens = 0

    def _sink(self, event: Event) -> None:  # called from the scheduler thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def start(self) -> None:
        for job in self.jobs:
            self.engine.submit(job)

    def close(self) -> None:
        """Drop the jobs from the batch (a no-op once they finished) and call `on_close`;
        only the first call counts."""
        if self.closed:
            return
        self.closed = True
        for job in self.jobs:
            self.engine.cancel(job)
        self.on_close()

    async def events(self, wait: Callable[[], object] | None = None) -> AsyncIterator[Event]:
        """Engine events until every choice is done; raises ApiError(500) on a failure.

        `wait`, if given, is awaited whenever no event came for a while (a disconnect check).
        """
        remaining = self.choices
        while remaining:
            try:
                event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if wait is not None:
                    await wait()
                continue
            if isinstance(event, Failed):
                raise ApiError(500, event.message, kind="server_error")
            if isinstance(event, Done):
                remaining -= 1
                self.completion_tokens += event.tokens
            yield event

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


async def whole(run: Run, reply: Reply, is_disconnected) -> dict:
    """Wait for every choice and return the complete response object."""

    async def check() -> None:
        if await is_disconnected():
            raise ClientGone

    texts = [""] * run.choices
    reasons = ["stop"] * run.choices
    async for event in run.events(wait=check):
        if isinstance(event, Delta):
            texts[event.index] += event.text
        elif isinstance(event, Done):
            reasons[event.index] = event.reason
    return reply.whole(texts, reasons, run.usage())


async def stream(run: Run, reply: Reply, *, include_usage: bool) -> AsyncIterator[dict]:
    """Server-sent events in OpenAI's chunk format, ending with `[DONE]`."""
    if reply.chat:
        for index in range(run.choices):
            yield _data(reply.role_chunk(index))
    readers = ToolStreams(reply, run.choices) if reply.tools is not None else None
    try:
        async for event in run.events():
            if readers is not None:
                for chunk in readers.chunks(event):
                    yield _data(chunk)
            elif isinstance(event, Delta):
                yield _data(reply.chunk(event.index, text=event.text))
            elif isinstance(event, Done):
                yield _data(reply.chunk(event.index, reason=event.reason))
    except ApiError as e:
        yield _data(e.body)
    else:
        if include_usage:
            yield _data(reply.usage_chunk(run.usage()))
    yield {"data": "[DONE]"}


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False)}


class ToolStreams:
    """The stream chunks of a request that offered tools: each choice's text goes through
    a ToolCallReader, so text that may be a call is held until it is decided, and each
    call goes out whole as a tool_calls delta."""

    def __init__(self, reply: Reply, choices: int):
        self.reply = reply
        self.readers = [ToolCallReader(reply.tools) for _ in range(choices)]

    def chunks(self, event: Event) -> list[dict]:
        reader = self.readers[event.index]
        if isinstance(event, Delta):
            return self._pieces(event.index, reader.feed(event.text))
        if isinstance(event, Done):
            out = self._pieces(event.index, reader.finish())
            reason = reader.finish_reason(event.reason)
            return [*out, self.reply.chunk(event.index, reason=reason)]
        return []

    def _pieces(self, index: int, pieces) -> list[dict]:
        out, reader = [], self.readers[index]
        calls_before = reader.calls - sum(isinstance(p, ToolCall) for p in pieces)
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.append(self.reply.tool_call_chunk(index, piece, calls_before))
                calls_before += 1
            else:
                out.append(self.reply.chunk(index, text=piece))
        return out
