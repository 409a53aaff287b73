"""Stopping a run early without losing or faking work: preemption signals and divergence.

Preemption: SIGTERM (what SLURM, Kubernetes and spot instances send before killing) and
`train.preempt_signal` (e.g. SIGUSR1 for SLURM's `--signal=USR1@90`). Before the first step
the signal stops the process at once (Preempted, exit 7: nothing to save). During the loop
the handler only records it; at the end of each step the ranks agree in one small collective
(any rank signalled: all stop), save one checkpoint and exit 7; the same command resumes.

Divergence: a non-finite loss or gradient norm stops the run (Diverged, exit 6) before any
checkpoint or final output of the broken weights is written. Under fp16 the loss scaler
skips such a step instead (its update is never applied) and halves its scale; a run whose
steps keep being skipped until the scale falls below MIN_LOSS_SCALE trains nothing, and
stops the same way (`SkippedSteps`).
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.distributed.process_group import DistContext
from keel.errors import Diverged, Preempted
from keel.signals import SignalHandling

# train.preempt_signal's choices beside "none"; SIGTERM is always handled.
PREEMPT_SIGNALS = {"SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2}


class Preemption(SignalHandling):
    """One run's preemption signals (every process). Use as a context manager around the
    run: the previous handlers come back when it ends."""

    def __init__(self, preempt_signal: str = "none"):
        extra = [] if preempt_signal == "none" else [PREEMPT_SIGNALS[preempt_signal]]
        super().__init__([signal.SIGTERM, *extra], self._handle)
        self.received: int | None = None  # the signal number, once one arrived
        self.in_loop = False

    def __enter__(self) -> Preemption:
        # Python lets only the main thread set handlers; a run started from another thread
        # (a notebook's worker, a test harness) keeps the process's own handling.
        if threading.current_thread() is threading.main_thread():
            super().__enter__()
        return self

    def _handle(self, number: int, _frame) -> None:
        self.received = number
        if not self.in_loop:  # set-up: nothing to save, so stop now instead of after it
            raise Preempted(
                f"{signal.Signals(number).name} arrived before the first training step; "
                f"nothing was trained in this attempt, so no checkpoint was saved. Run the "
                f"same command to start again (train.resume=auto continues from the newest "
                f"checkpoint, if an earlier attempt saved one)"
            )

    def enter_loop(self) -> None:
        """From now on a signal is only recorded, and acted on at the end of a step."""
        self.in_loop = True

    def agreed(self, dist: DistContext) -> bool:
        """Whether any rank was signalled: the same answer on every rank (one collective of
        one number, on the CPU backend: no device sync). Every rank calls it every step."""
        mine = 0.0 if self.received is None else 1.0
        return dist.all_reduce_sum([mine])[0] > 0

    def stopped(self, step: int, checkpoint: str) -> Preempted:
        """The error that ends a preempted run after its checkpoint at `step` was saved."""
        name = signal.Signals(self.received).name if self.received else "a preemption signal"
        return Preempted(
            f"preempted: {name} arrived (on this or another rank); every rank finished step "
            f"{step} and the checkpoint {checkpoint} was saved. Run the same command to "
            f"resume from it (train.resume=auto)"
        )


def check_finite(
    losses: list[float],
    grad_norms: list[float],
    first_step: int,
    newest: Callable[[], Path | None],
) -> None:
    """Raise Diverged at the first step (1-based `first_step` for the first value) whose
    loss or gradient norm is not finite; `newest()` names the newest complete checkpoint,
    asked only then (a folder listing kept off the log steps). The values are global
    (all-reduced losses, the global norm): every rank decides alike."""
    for offset, (loss, norm) in enumerate(zip(losses, grad_norms)):
        which = (
            f"the loss is {loss}"
            if not math.isfinite(loss)
            else f"the gradient norm is {norm}"
            if not math.isfinite(norm)
            else None
        )
        if which:
            kept = _kept(newest())
            raise Diverged(
                f"training diverged at step {first_step + offset}: {which}. Nothing after "
                f"it was saved and no final outputs were written; {kept}. Lower train.lr, "
                f"add warm-up (train.warmup_steps) or keep gradient clipping on "
                f"(train.max_grad_norm), and run again"
            )


# fp16's loss scaler starts at 2**16 and halves at each skipped step: below 1 it has skipped
# 16 more steps than it grew back (its growth takes 2000 good steps), so the loss or the
# gradients overflow at any scale. DeepSpeed's min_loss_scale ends a run there too.
MIN_LOSS_SCALE = 1.0


@dataclass
class SkippedSteps:
    """The steps fp16's loss scaler skipped in a row (their gradients not finite), counted
    over the read-back windows; a few at the start are the scale calibrating itself."""

    since: int | None = None  # the first step of the current run of skipped steps
    loss: float = math.nan  # the last skipped step's loss

    def add(self, losses: list[float], grad_norms: list[float], first_step: int) -> None:
        for offset, (loss, norm) in enumerate(zip(losses, grad_norms)):
            if math.isfinite(loss) and math.isfinite(norm):
                self.since = None
            elif self.since is None:
                self.since, self.loss = first_step + offset, loss
            else:
                self.loss = loss

    def check(self, step: int, scale: float, newest: Callable[[], Path | None]) -> None:
        """Raise Diverged when steps are still being skipped at `step` with the loss scale
        (every rank's: the scaler agrees on overflows) below MIN_LOSS_SCALE."""
        if self.since is None or scale >= MIN_LOSS_SCALE:
            return
        kept = _kept(newest())
        raise Diverged(
            f"training diverged under fp16 at step {step}: every step since step "
            f"{self.since} had non-finite gradients (the last loss {self.loss}), so the loss "
            f"scaler skipped each update and its scale fell to {scale:g}, below "
            f"{MIN_LOSS_SCALE:g}: the model overflows fp16 at any scale and trains nothing. "
            f"No final outputs were written; {kept}. Train in bf16 or fp32 (train.precision) "
            f"where the hardware allows, or lower train.lr and add warm-up "
            f"(train.warmup_steps), and run again"
        )


def _kept(checkpoint: Path | None) -> str:
    """What a diverged run leaves to resume from."""
    if checkpoint is None:
        return "no checkpoint was saved before it"
    return f"the newest complete checkpoint, {checkpoint}, is kept"
