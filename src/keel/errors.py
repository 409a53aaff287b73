"""User-facing error types.

Anything the user can fix (a config key, a data file, a path) raises a `KeelError`
subclass; the CLI prints its message and exits with code 2, no traceback unless `--debug`.
Internal invariants use `assert` instead.
"""

from __future__ import annotations


class KeelError(Exception):
    """Base class: a problem the user can fix. The message says what, where and how."""

    exit_code = 2


class ConfigError(KeelError):
    """The config is invalid. Holds every problem found, not just the first."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        head = f"{len(self.problems)} problem(s){where}:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


class DataError(KeelError):
    """The training data cannot be used as given (missing file, malformed rows, ...)."""


class ImageError(KeelError):
    """An image reference cannot be used (missing, undecodable, too big); names the reference."""


class ModelError(KeelError):
    """The model or tokenizer cannot be loaded or saved as asked."""


class CheckpointError(KeelError):
    """A checkpoint is missing, incomplete or does not match the run."""


class OutOfMemory(KeelError):
    """A step ran out of device (or host) memory; the message names the micro-batch and
    what to change. The newest complete checkpoint is untouched and resumable."""

    exit_code = 3


class Diverged(KeelError):
    """The loss or the gradient norm stopped being finite (outside fp16's loss scaler, which
    skips such steps by design). The message names the step; the newest complete checkpoint
    is kept and no final outputs are written."""

    exit_code = 6


class Preempted(KeelError):
    """SIGTERM (or train.preempt_signal) arrived: every rank finished its step, one
    checkpoint was saved, and the same command resumes the run (train.resume=auto)."""

    exit_code = 7
