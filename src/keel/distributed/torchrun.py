"""torchrun, exiting with the workers' own exit code instead of 1.

`python -m torch.distributed.run` exits 1 whatever code a failed worker had, so the 4 of a
hang (or 3 of out of memory, 7 of a preempted run) never reached a script or SLURM's
requeue logic. `keel.distributed.launch` runs this module in torchrun's place: it calls
torchrun's own entry point in this process, and when workers fail, prints torchrun's
failure table and exits with the code that says what happened (`exit_code_of`).

Preemption reaching this process (SIGTERM from `scancel` or Kubernetes, SIGUSR1/SIGUSR2
from SLURM's `--signal`): torchrun would stop the workers after a short grace and exit 1
(SIGTERM), or die at once (SIGUSR1/2). Here the signal is passed to the workers as SIGTERM,
which every keel worker handles (the launcher cannot know `train.preempt_signal`, and a
SIGUSR1 a worker does not handle would kill it), and this process waits for them to save
their checkpoint and exit 7. It then stops, so torchrun's `--max-restarts` never restarts a
preempted run inside the allocation that is going away (`PreemptionForwarding`).

The launcher's process stays light: torch is imported only here, in torchrun's process.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping

import psutil

from keel.signals import SignalHandling

# keel's own exit codes (keel.errors and keel.distributed.watchdog): 2 user error, 3 out
# of memory, 4 hang, 5 stall, 6 diverged, 7 preempted.
KEEL_CODES = range(2, 8)
PREEMPTED = 7
# Handled here, not by torchrun: its handler would end the workers instead of letting them
# save. torchrun keeps the rest of its default list (Ctrl-C and hang-ups stop the workers).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def exit_code_of(failures: Mapping[int, tuple[int, float]]) -> int:
    """The exit code of a failed job from its failed workers' (exit code, time of failure),
    by global rank; a negative code is a signal, as torchrun records it.

    keel's own codes win over the rest: when one rank meets a hang, runs out of memory or
    is preempted, it exits with that code, and torchrun then ends its peers with SIGTERM
    (or they fail in a collective with 1). Among several, the first failure wins (then the
    lowest rank). Without any, the first failure's own code; a signal N gives 128 + N, as
    a shell reports a process killed by it.
    """
    ordered = sorted(failures.items(), key=lambda item: (item[1][1], item[0]))
    codes = [code for _rank, (code, _when) in ordered]
    keel = [code for code in codes if code in KEEL_CODES]
    code = keel[0] if keel else codes[0]
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


class WorkersStopped(BaseException):
    """Raised out of torchrun's agent once the preempted workers have all exited; carries
    their (exit code, time) by process id, as `exit_code_of` takes them. A BaseException,
    like SystemExit, so that no `except Exception` in the agent's loop can swallow it."""

    def __init__(self, name: str, codes: dict[int, tuple[int, float]]):
        super().__init__(f"{name}: the workers stopped")
        self.name = name
        self.codes = codes


def _exit_status(pid: int) -> int | None:
    """Wait for child `pid` to end and return its exit code (-N for signal N), leaving it
    for torchrun to reap (WNOWAIT); None when torchrun already reaped it."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return None
    if result is None:
        return None
    return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status


class PreemptionForwarding(SignalHandling):
    """While active (a context manager, main thread only): on SIGTERM, SIGUSR1 or SIGUSR2,
    send SIGTERM to this process's children (torchrun's workers), wait until every one has
    exited, then raise WorkersStopped. Raised from the handler, in torchrun's main thread,
    it ends the agent before its monitor sees the failed group, so nothing is restarted."""

    def __init__(self, log=lambda message: print(message, file=sys.stderr, flush=True)):
        super().__init__(PREEMPTION_SIGNALS, self._handle)
        self._log = log
        self._stopping = False

    def _handle(self, number: int, _frame) -> None:
        name = signal.Signals(number).name
        workers = psutil.Process().children()  # torchrun starts its workers directly
        for worker in workers:
            try:
                worker.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        if self._stopping:
            return  # a repeated signal: passed on; the first handler is still waiting
        self._stopping = True
        self._log(
            f"keel: {name} received; sent SIGTERM to {len(workers)} worker(s), waiting for "
            f"them to save a checkpoint and exit {PREEMPTED}"
        )
        codes = {}
        for worker in workers:
            code = _exit_status(worker.pid)
            if code is not None:
                codes[worker.pid] = (code, time.time())
        raise WorkersStopped(name, codes)


def _report(codes: Mapping[int, tuple[int, float]], code: int, *, who: str = "rank") -> None:
    listed = ", ".join(f"{who} {r}: {_describe(c)}" for r, (c, _t) in sorted(codes.items()))
    print(f"keel: worker exit codes {listed}; exiting with {code}", file=sys.stderr)


def _run_torchrun(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun's options come before the worker's entry point (which takes what follows it).
    argv = ["--signals-to-handle", TORCHRUN_SIGNALS, *argv]
    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        print(exc, file=sys.stderr)  # torchrun's failure table, without our traceback
        failures = {rank: (f.exitcode, f.timestamp) for rank, f in exc.failures.items()}
        code = exit_code_of(failures)
        _report(failures, code)
        return code
    return 0


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; 0 when every worker succeeded, else `exit_code_of`.

    SIGTERM, SIGUSR1 and SIGUSR2 are handled here (see PreemptionForwarding), from before
    torch is imported; argv must not set --signals-to-handle, which would give them back
    to torchrun.
    """
    try:
        with PreemptionForwarding():
            return _run_torchrun(argv)
    except WorkersStopped as stopped:
        # No worker left (the signal came before they started): nothing ran, nothing lost.
        code = exit_code_of(stopped.codes) if stopped.codes else PREEMPTED
        _report(stopped.codes, code, who="pid")
        return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
