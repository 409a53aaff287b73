"""What the HTTP side hands a generation backend (jobs), what it gets back (events), and the
thread that owns the model and runs one backend step at a time."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from keel.infer.serve.sampling import SamplingParams


@dataclass(frozen=True)
class Delta:
    """New text of choice `index`."""

    index: int
    text: str


@dataclass(frozen=True)
class Done:
    """Choice `index` finished: reason "stop" (end of turn or stop string) or "length".
    `token_ids`: the sampled tokens, the stop token included (keel's engine; () elsewhere)."""

    index: int
    reason: str
    tokens: int
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Failed:
    """The job could not be finished; `message` says why, `error` is what was raised (None:
    no exception), so a caller on the engine's thread can raise it again as it was."""

    message: str
    error: BaseException | None = None


Event = Delta | Done | Failed


@dataclass(eq=False, kw_only=True)
class Job:
    """One prompt to complete `n` times with served model `model`."""

    prompt_ids: list[int]
    params: SamplingParams
    model: str
    sink: Callable[[Event], None]
    n: int = 1
    first_index: int = 0  # choice index of the first of the n completions
    cancelled: bool = False
    # A prompt with images: keel.infer.vision.ImagePrompt (forward inputs, M-RoPE
    # positions); None for text.
    images: object | None = None


@dataclass
class EngineStats:
    running: int = 0  # sequences in the batch
    waiting: int = 0  # jobs not yet admitted
    steps: int = 0
    generated_tokens: int = 0
    peak_batch: int = 0


class SchedulerThread(ABC):
    """One thread owns the model; other threads submit jobs, cancel them, or queue calls.

    Subclasses implement `step` (one round: take new work with `_take`, generate, send
    events), `_busy` (work in progress) and `_shutdown` (end what is left).
    """

    def __init__(self, name: str):
        self.stats = EngineStats()
        self._name = name
        self._wakeup = threading.Condition()
        self._inbox: list[Job] = []
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def submit(self, job: Job) -> None:
        with self._wakeup:
            self._inbox.append(job)
            self._wakeup.notify_all()

    def cancel(self, job: Job) -> None:
        """Drop `job` (its client is gone); its sequences leave the batch at the next step."""
        job.cancelled = True
        with self._wakeup:
            self._wakeup.notify_all()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` in the scheduler thread between two steps; the future holds its result."""
        future: Future = Future()
        with self._wakeup:
            self._calls.append((fn, future))
            self._wakeup.notify_all()
        return future

    @abstractmethod
    def step(self) -> bool:
        """One scheduler round; True while work remains."""

    @abstractmethod
    def _busy(self) -> bool:
        """Whether any sequence is running or waiting."""

    @abstractmethod
    def _shutdown(self, message: str) -> None:
        """End every job with `message` (the server is stopping or the engine failed)."""

    def _take(self) -> list[Job]:
        """Run the queued calls; return the jobs submitted since the last round."""
        with self._wakeup:
            calls, self._calls = self._calls, []
            jobs, self._inbox = self._inbox, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as e:  # the caller gets it through the future
                future.set_exception(e)
        return jobs

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not (self._stopping or self._inbox or self._calls or self._busy()):
                    self._wakeup.wait()
                if self._stopping:
                    break
            self.step()
        message = "the server is shutting down"
        self._shutdown(message)
        for job in self._inbox:
            job.sink(Failed(message))
