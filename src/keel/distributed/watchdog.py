"""A thread per process that notices when training stops moving, and says why.

The main thread records cheap progress marks (`Progress`: step, micro-batch, layer, each of
keel's collectives) and the collectives it makes (`CollectiveLog`: sequence number, op,
shapes, dtype). The watchdog thread looks at them every second:

- **hang** (several processes): the main thread made no progress for `hang_timeout_s`
  inside a watched phase, and no other rank made any either (waiting in a collective for a
  rank that still marks progress, a slow generation say, is not a hang). Detection does
  not depend on the stuck backend: every rank publishes a heartbeat to the rendezvous
  store torchrun already runs (a side channel), so
  the first rank to notice can tell which ranks are behind (their progress marks), which
  stopped responding (their heartbeat no longer moves), and where the collective sequences
  first differ. It asks every live rank to write its stacks to `<output.dir>/diagnostics/`,
  writes one report there and to the console, and exits with `EXIT_HANG`.
- **stall** (every run): a step runs longer than the stall limit (default: max(60 s, 10x
  the median step after warm-up)). It dumps every thread's stack and the memory state, then
  keeps waiting (`on_stall: warn`) or exits with `EXIT_STALL` (`abort`).
- **memory** (CPU): RSS above the limit is flagged; the main thread raises out-of-memory
  at its next progress mark, before the kernel's OOM killer ends the process silently.
  During data preparation (`Progress.memory_watched`) the watchdog ends the process itself
  with exit 3, naming the phase: the main thread may be in one long library call there.

Phases with long legitimate waits (checkpoint save/load, rank 0 tokenizing, writing the
outputs) carry their own limits.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from keel.distributed.hang_report import build_hang_report, end_frozen_siblings

EXIT_OUT_OF_MEMORY = 3  # keel.errors.OutOfMemory's
EXIT_HANG = 4
EXIT_STALL = 5
MEMORY_HINT = (
    "lower data.max_row_bytes or data.num_proc, or split the data files; free memory on "
    "this machine, or run fewer processes on it"
)
WARMUP_STEPS = 3  # steps excluded from the median step time (first-step compilation etc.)
WARMUP_STALL_S = 600.0  # stall limit while the median is unknown
MIN_STALL_S = 60.0
DIAGNOSTICS = "diagnostics"


@dataclass(frozen=True)
class WatchdogSettings:
    hang_timeout_s: float
    stall_timeout_s: float | None  # None: auto
    on_stall: str  # warn | abort
    diagnostics_dir: Path
    interval_s: float = 1.0
    rss_limit_bytes: int | None = None  # in steps (CPU; a GPU raises its own OOM)
    host_rss_limit_bytes: int | None = None  # in memory-watched phases, on any device


class Progress:
    """Where the main thread is. It writes plain attributes (cheap, atomic under the GIL);
    the watchdog thread only reads them."""

    def __init__(self) -> None:
        self.point = 0  # progress marks so far; ranks making the same calls agree on it
        self.where: str | tuple = "starting"
        self.step = 0  # the optimizer step in progress (1-based), 0 before training
        self.changed = time.monotonic()
        self.phases: list[tuple[str, float | None, float]] = []  # (name, limit, since)
        self.step_started: float | None = None
        self.step_seconds: deque[float] = deque(maxlen=256)
        self.alarm: Callable[[], None] | None = None  # raises in the main thread when set
        self.memory_phases: list[str] = []  # phases outside steps under the memory check

    def mark(self, where: str | tuple) -> None:
        self.point += 1
        self.where = where
        self.changed = time.monotonic()
        if self.alarm is not None:
            self.alarm()

    @contextmanager
    def phase(self, name: str, limit: float | None):
        """A region of the run; `limit`: seconds without progress before it counts as a
        hang (None: not watched)."""
        self.phases.append((name, limit, time.monotonic()))
        self.mark(f"{name}: begin")
        try:
            yield
        finally:
            self.phases.pop()
            self.mark(f"{name}: end")

    @contextmanager
    def memory_watched(self, what: str):
        """Put a region outside the steps (data preparation) under the memory check: RSS
        over the limit there ends the process with exit 3 and a message naming `what`."""
        self.memory_phases.append(what)
        try:
            yield
        finally:
            self.memory_phases.pop()

    def step_begin(self, step: int) -> None:
        self.step = step
        self.step_started = time.monotonic()
        self.mark("step begin")

    def step_end(self, seconds: float) -> None:
        self.step_started = None
        self.step_seconds.append(seconds)
        self.mark("step end")

    def describe(self) -> str:
        where = self.where
        if isinstance(where, tuple):  # ("layer", index, "forward") from a module hook
            where = " ".join(str(part) for part in where)
        return f"step {self.step}: {where}" if self.step else str(where)


@dataclass(frozen=True)
class CollectiveRecord:
    seq: int
    op: str
    signature: str  # shapes and dtypes, or the payload kind for object collectives
    step: int

    def __str__(self) -> str:
        return f"#{self.seq} {self.op}({self.signature}) at step {self.step}"


class CollectiveLog:
    """keel's own collectives on this rank, numbered; the latest are kept."""

    def __init__(self, keep: int = 32) -> None:
        self.next_seq = 0
        self.recent: deque[CollectiveRecord] = deque(maxlen=keep)

    def record(self, op: str, signature: str, step: int) -> CollectiveRecord:
        entry = CollectiveRecord(self.next_seq, op, signature, step)
        self.next_seq += 1
        self.recent.append(entry)
        return entry


def format_stacks() -> str:
    """Every thread's Python stack, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, ident)} (id {ident}):\n{stack}")
    return "\n".join(parts)


def memory_state() -> dict[str, float]:
    """RSS, and on a GPU allocated/reserved memory and their peaks, in MB (reserved is what
    the caching allocator holds, closer to what nvidia-smi shows)."""
    state = {"rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mb = 2**20
        state.update(
            cuda_alloc_mb=round(torch.cuda.memory_allocated() / mb, 1),
            cuda_peak_mb=round(torch.cuda.max_memory_allocated() / mb, 1),
            cuda_reserved_mb=round(torch.cuda.memory_reserved() / mb, 1),
            cuda_peak_reserved_mb=round(torch.cuda.max_memory_reserved() / mb, 1),
        )
    return state


class Watchdog:
    """The watchdog thread of one process; see the module docstring."""

    def __init__(
        self,
        settings: WatchdogSettings,
        *,
        rank: int = 0,
        world_size: int = 1,
        store=None,
        progress: Progress | None = None,
        collectives: CollectiveLog | None = None,
    ):
        self.settings, self.rank, self.world_size = settings, rank, world_size
        self.store = store  # a c10d store shared by all ranks (None: one process)
        self.progress = progress or Progress()
        self.collectives = collectives or CollectiveLog()
        self.beat = 0
        self.rss_exceeded: tuple[int, int] | None = None
        self._stalled_step: int | None = None
        self._dumped = False
        self._peer_beat: tuple[int, float] | None = None  # (beat, since) of the next rank
        self._waiting_on: int | None = None  # the working rank this idle rank waited for last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keel-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (watchdog.enabled)
            self._thread.join(timeout=5)
        if self.store is not None:  # peers must not take a finished rank for a frozen one
            self._store_set(f"hb/{self.rank}", json.dumps({**self.heartbeat(), "done": True}))

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        failing_since = None  # when the store stopped answering
        while not self._stop.wait(self.settings.interval_s):
            try:
                self._tick()
                failing_since = None
            except Exception as exc:  # the watchdog must never take training down
                print(
                    f"keel watchdog (rank {self.rank}): {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                failing_since = failing_since or time.monotonic()
                silent = time.monotonic() - failing_since
                if self.store is not None and silent > self.settings.hang_timeout_s:
                    # Under srun the store lives in rank 0's process: if that process is
                    # stopped, so is the side channel. Report what this rank knows.
                    self.store = None
                    self.alarm(
                        f"the rendezvous store has not answered for {silent:.0f} s (the "
                        f"process that hosts it, rank 0 under srun, may be stopped or dead): "
                        f"{type(exc).__name__}: {exc}"
                    )

    def _tick(self) -> None:
        self.beat += 1
        if self.store is not None:
            self._publish()
            if not self._dumped and self._store_has("alarm"):
                self._dump_stacks()
        self._check_hang()
        self._check_peer()
        self._check_stall()
        self._check_memory()

    def heartbeat(self) -> dict:
        progress = self.progress
        now = time.monotonic()
        phase = progress.phases[-1] if progress.phases else None
        return {
            "rank": self.rank,
            "beat": self.beat,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "host": socket.gethostname(),
            "step": progress.step,
            "point": progress.point,
            "where": progress.describe(),
            "idle_s": round(now - progress.changed, 2),
            "phase": phase[0] if phase else None,
            "collectives": [
                [c.seq, c.op, c.signature, c.step] for c in list(self.collectives.recent)
            ],
        }

    def _publish(self) -> None:
        self.store.set(f"hb/{self.rank}", json.dumps(self.heartbeat()))

    def _store_has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _check_hang(self) -> None:
        progress = self.progress
        if self.world_size < 2 or not progress.phases:
            return
        name, limit, _since = progress.phases[-1]
        idle = time.monotonic() - progress.changed
        if limit is not None and idle > limit and not self._waiting_on_working_rank(limit):
            self.alarm(
                f"rank {self.rank} made no progress for {idle:.1f} s (limit {limit:.0f} s,"
                f" phase '{name}') at {progress.describe()}"
            )

    def _waiting_on_working_rank(self, limit: float) -> bool:
        """True when another rank made progress within `limit` s: this one is waiting for it
        (in the collective after one rank's long generation, say), which is slow, not stuck.
        The job is stuck once no rank moves. A rank that stops beating altogether is the ring
        check's to report (_check_peer). The rank found working is asked first next time, so
        a long wait costs one store read per second, not one per rank."""
        if self.store is None:
            return False
        others = [r for r in range(self.world_size) if r != self.rank]
        if self._waiting_on is not None:
            others.insert(0, others.pop(others.index(self._waiting_on)))
        for rank in others:
            if self._store_has(f"hb/{rank}"):
                beat = json.loads(self.store.get(f"hb/{rank}"))
                if not beat.get("done") and beat["idle_s"] <= limit:
                    self._waiting_on = rank
                    return True
        self._waiting_on = None
        return False

    def _check_peer(self) -> None:
        """Watch the next rank's heartbeat (a ring: every rank is watched by one other, so
        the store sees O(ranks) reads). A frozen heartbeat means a stopped, killed or
        wedged process, whatever phase the others are in (a checkpoint save included)."""
        if self.store is None or self.world_size < 2:
            return
        peer = (self.rank + 1) % self.world_size
        if not self._store_has(f"hb/{peer}"):
            return  # not started yet: a slow start is the rendezvous timeout's business
        heartbeat = json.loads(self.store.get(f"hb/{peer}"))
        if heartbeat.get("done"):
            return
        beat, now = heartbeat["beat"], time.monotonic()
        if self._peer_beat is None or self._peer_beat[0] != beat:
            self._peer_beat = (beat, now)
        elif now - self._peer_beat[1] > self.settings.hang_timeout_s:
            self.alarm(
                f"rank {peer} sent no heartbeat for {now - self._peer_beat[1]:.1f} s "
                f"(limit {self.settings.hang_timeout_s:.0f} s): its process is stopped,"
                f" killed or frozen"
            )

    def stall_limit(self) -> tuple[float, str]:
        """(seconds, why) a step may run before it counts as stalled."""
        if self.settings.stall_timeout_s is not None:
            return self.settings.stall_timeout_s, "watchdog.stall_timeout_s"
        settled = list(self.progress.step_seconds)[WARMUP_STEPS:]
        if not settled:
            return WARMUP_STALL_S, "auto, during warm-up"
        median = statistics.median(settled)
        return max(
            MIN_STALL_S, 10 * median
        ), f"auto: max({MIN_STALL_S:.0f} s, 10 x median step {median:.2f} s)"

    def _check_stall(self) -> None:
        started, step = self.progress.step_started, self.progress.step
        if started is None or self._stalled_step == step:
            return
        running = time.monotonic() - started
        limit, why = self.stall_limit()
        if running <= limit:
            return
        self._stalled_step = step
        abort = self.settings.on_stall == "abort"
        head = (
            f"keel watchdog: step {step} has run for {running:.1f} s, over the stall "
            f"limit of {limit:.1f} s ({why}) on rank {self.rank}; at "
            f"{self.progress.describe()}; memory {memory_state()}; "
            + (
                "aborting (watchdog.on_stall=abort)"
                if abort
                else "still waiting (watchdog.on_stall=warn)"
            )
        )
        path = self._write(
            f"stall-step-{step:08d}-rank-{self.rank:05d}.txt", f"{head}\n\n{format_stacks()}"
        )
        print(
            f"{head}\nstacks of every thread: {path}\n{format_stacks()}",
            file=sys.stderr,
            flush=True,
        )
        if abort:
            os._exit(EXIT_STALL)

    def _check_memory(self) -> None:
        progress = self.progress
        if progress.step_started:
            limit = self.settings.rss_limit_bytes
        else:
            limit = self.settings.host_rss_limit_bytes if progress.memory_phases else None
        if limit is None or self.rss_exceeded is not None:
            return
        rss = psutil.Process().memory_info().rss
        if rss <= limit:
            return
        if progress.step_started:  # raised in the main thread at its next progress mark
            self.rss_exceeded = (rss, limit)
            return
        # Data preparation: the main thread may be inside one long library call (a parser,
        # the tokenizer) and reach no mark before the kernel's OOM killer ends the process
        # without a word; nothing is saved there, so end it here, saying why.
        print(
            f"error: out of memory on rank {self.rank} during {progress.memory_phases[-1]}: "
            f"resident memory {rss / 2**30:.2f} GiB is over this process's limit of "
            f"{limit / 2**30:.2f} GiB ({progress.describe()}); {MEMORY_HINT}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_OUT_OF_MEMORY)

    # -- alarms ----------------------------------------------------------------------
    def alarm(self, reason: str) -> None:
        """A hang (or diverged collectives): dump, report, exit. Never returns."""
        first = True
        if self.store is not None:
            try:
                first = self.store.add("alarm_count", 1) == 1
                if first:
                    self.store.set("alarm", json.dumps({"rank": self.rank, "reason": reason}))
            except Exception as exc:  # the store is gone: report what this rank knows
                reason += f" (the rendezvous store did not answer: {exc})"
                self.store = None
        self._dump_stacks()
        if first:
            report, beats, live = self._hang_report(reason)
            path = self._write("hang-report.txt", report)
            print(f"{report}\nreport: {path}", file=sys.stderr, flush=True)
            self._store_set("reported", "1")
            end_frozen_siblings(beats, live)
        else:  # keep beating while the first rank writes the report: we are alive
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and not self._store_has_safe("reported"):
                self.beat += 1
                self._store_set(f"hb/{self.rank}", json.dumps(self.heartbeat()))
                time.sleep(min(0.5, self.settings.interval_s))
        os._exit(EXIT_HANG)

    def _dump_stacks(self) -> None:
        self._dumped = True
        text = (
            f"rank {self.rank} (pid {os.getpid()}), {self.progress.describe()}, memory "
            f"{memory_state()}\n\n{format_stacks()}"
        )
        self._write(f"rank-{self.rank:05d}-stacks.txt", text)
        self._store_set(f"dumped/{self.rank}", "1")

    def _hang_report(self, reason: str) -> tuple[str, dict[int, dict | None], set[int]]:
        """Who is behind, who stopped answering, where the collective sequences differ."""
        first = self._heartbeats()
        time.sleep(2 * self.settings.interval_s + 0.5)  # long enough for live ranks to beat
        second = self._heartbeats()
        deadline = time.monotonic() + 5.0
        live = [
            r
            for r in second
            if self._store_has_safe(f"dumped/{r}")
            or (second[r] and first.get(r) and second[r]["beat"] != first[r]["beat"])
        ]
        while time.monotonic() < deadline and not all(
            self._store_has_safe(f"dumped/{r}") for r in live
        ):
            time.sleep(0.2)
        beats = {r: second.get(r) or first.get(r) for r in range(self.world_size)}
        beats[self.rank] = self.heartbeat()
        live_set = set(live) | {self.rank}
        report = build_hang_report(
            reason, beats, live=live_set, diagnostics=self.settings.diagnostics_dir
        )
        return report, beats, live_set

    def _heartbeats(self) -> dict[int, dict | None]:
        found: dict[int, dict | None] = {}
        for r in range(self.world_size):
            try:
                found[r] = (
                    json.loads(self.store.get(f"hb/{r}"))
                    if self.store and self._store_has(f"hb/{r}")
                    else None
                )
            except Exception:
                found[r] = None
        return found

    def _store_has_safe(self, key: str) -> bool:
        try:
            return self.store is not None and self._store_has(key)
        except Exception:
            return False

    def _store_set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(key, value)
            except Exception:
                pass

    def _write(self, name: str, text: str) -> Path:
        folder = self.settings.diagnostics_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(text, encoding="utf-8")
        return path
