"""Fault injection for tests: `KEEL_FAULT=<kind>:<step>[:<rank>[:<seconds>]]`.

The guardrails (hang watchdog, stall detector, out-of-memory handling) are tested with real
processes meeting real failures, the way users meet them. This is the one environment
variable keel reads for behaviour (STYLE.md, habit 5); without it no code path changes.

Kinds, each firing once, during optimizer step `step` (1-based, as in metrics.jsonl), on
rank `rank` (default 0):
  hang             the rank sleeps forever inside the step, before its collectives
  stall            the rank sleeps `seconds` inside the step, then carries on
  skip_collective  the rank skips one of keel's own collectives in that step
  exit             the rank exits with code 1 at the start of the step
  oom              the forward pass raises torch.OutOfMemoryError
  nan              the forward pass's embeddings turn NaN (the loss, gradients and, after
                   the update, the weights follow: a diverged step)

Generation kinds fire inside a grpo step's rollout generation, after an engine round (a
step that generates: with grpo.num_iterations mu, every mu-th step):
  hang_generation  the rank sleeps forever after its first round of the step (a rank stuck
                   while generating, with its peers waiting in the step's collectives)
  slow_generation  the rank sleeps `seconds` after EVERY round of the step (slow generation
                   that keeps marking progress: not a hang, however long it takes in all)
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from keel.errors import KeelError

ENV = "KEEL_FAULT"
KINDS = (
    "hang",
    "stall",
    "skip_collective",
    "exit",
    "oom",
    "nan",
    "hang_generation",
    "slow_generation",
)


@dataclass
class Fault:
    kind: str
    step: int
    rank: int = 0
    seconds: float = 0.0
    fired: bool = field(default=False, compare=False)

    def due(self, kind: str, step: int, rank: int) -> bool:
        """True (once) when this fault is of `kind` and its step and rank have come."""
        if self.fired or kind != self.kind or step != self.step or rank != self.rank:
            return False
        self.fired = True
        return True

    def during(self, kind: str, step: int, rank: int) -> bool:
        """True all through `step` on `rank` when this fault is of `kind` (a fault that
        fires at every site of its step, not once)."""
        return kind == self.kind and step == self.step and rank == self.rank


def fault_from_env(environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault `KEEL_FAULT` asks for, or None when it is unset.

    `os.environ` is looked up at each call, not bound once as a default: `datasets`' map
    with num_proc > 1 rebinds `os.environ` to a new object, and a bound default would then
    never see the variable again (measured: a KEEL_FAULT set after such a map was ignored)."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    parts = text.split(":")
    usage = (
        f"{ENV}={text!r}: expected <kind>:<step>[:<rank>[:<seconds>]], kind one of "
        f"{', '.join(KINDS)}"
    )
    if parts[0] not in KINDS or not 2 <= len(parts) <= 4:
        raise KeelError(usage)
    try:
        step = int(parts[1])
        rank = int(parts[2]) if len(parts) > 2 and parts[2] else 0
        seconds = float(parts[3]) if len(parts) > 3 else 0.0
    except ValueError:
        raise KeelError(usage) from None
    return Fault(kind=parts[0], step=step, rank=rank, seconds=seconds)


def at_step_start(fault: Fault | None, step: int, rank: int) -> None:
    """Fire a hang, stall or exit fault due at the start of `step` on `rank`."""
    if fault is None:
        return
    if fault.due("exit", step, rank):
        os._exit(1)
    if fault.due("stall", step, rank):
        time.sleep(fault.seconds)
    if fault.due("hang", step, rank):
        _sleep_forever()


def after_generation_round(fault: Fault | None, step: int, rank: int) -> None:
    """Fire a generation fault due after an engine round of `step`'s rollout generation on
    `rank`: slow_generation at every round of the step, hang_generation once."""
    if fault is None:
        return
    if fault.during("slow_generation", step, rank):
        time.sleep(fault.seconds)
    if fault.due("hang_generation", step, rank):
        _sleep_forever()


def _sleep_forever() -> None:
    while True:  # forever: only the watchdog (or a signal) ends this process
        time.sleep(3600)
