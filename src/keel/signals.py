"""Signal handlers for the length of a block, and the previous ones back at its end.

Shared by the run's own preemption handling (keel.train.stops) and torchrun's forwarding of
preemption signals to its workers (keel.distributed.torchrun); neither package may import
the other's, so this piece sits beside them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable


class SignalHandling:
    """A context manager (or the base of one) that sends `signals` to `handler(number,
    frame)` while active and gives each signal back the handler it had when the block ends.
    Python lets only the main thread set handlers: `__enter__` elsewhere raises ValueError."""

    def __init__(self, signals: Iterable[int], handler: Callable[[int, object], None]):
        self.signals = list(signals)
        self._handler = handler
        self._previous: dict[int, object] = {}

    def __enter__(self):
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handler)
        return self

    def __exit__(self, *_exc) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()
