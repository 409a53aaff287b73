"""What reward functions log while they score, through TRL's `log_metric` and `log_extra`
keyword arguments: scalar metrics for the step's record, and per-completion values for the
sample log. One RewardLog collects one scoring (a batch of completions on one process);
the trainer combines the processes' logs (keel.train.rollouts)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from keel.errors import KeelError


class RewardLogError(KeelError):
    """A reward function logged something keel cannot record (a reserved metric name, a
    non-number, a column of the wrong length); the message names the function."""


@dataclass
class RewardLog:
    """The metrics and sample columns logged during one scoring of `count` completions.

    metrics: each name's (sum, count) over the calls that logged it (TRL averages each
    metric over every call of the step, on every process). extras: each column's values,
    one JSON value per completion. `reserved`: metric names keel's own record uses."""

    count: int
    reserved: frozenset[str] = frozenset()
    metrics: dict[str, tuple[float, int]] = field(default_factory=dict)
    extras: dict[str, list] = field(default_factory=dict)

    def callbacks(self, function: str) -> dict[str, Callable]:
        """The `log_metric` and `log_extra` keyword arguments for reward function
        `function` (named in the errors)."""

        def log_metric(name: str, value: float) -> None:
            self.metric(function, name, value)

        def log_extra(column: str, values: list) -> None:
            self.extra(function, column, values)

        return {"log_metric": log_metric, "log_extra": log_extra}

    def metric(self, function: str, name: str, value) -> None:
        """Add one value of metric `name`; a NaN value is left out of its mean."""
        if not isinstance(name, str) or not name:
            raise RewardLogError(
                f"reward function {function} called log_metric with name {name!r}; a metric's "
                "name is a non-empty string"
            )
        if name in self.reserved:
            raise RewardLogError(
                f"reward function {function} logged metric '{name}', a name keel's step record "
                f"already uses; log it under another name (e.g. 'rewards/{name}')"
            )
        number = real_number(value)
        if number is None:
            raise RewardLogError(
                f"reward function {function} logged metric '{name}' = {value!r} "
                f"({type(value).__name__}); log_metric takes one real number"
            )
        total, count = self.metrics.get(name, (0.0, 0))
        if not math.isnan(number):
            total, count = total + number, count + 1
        self.metrics[name] = (total, count)

    def extra(self, function: str, column: str, given) -> None:
        """Set sample column `column` to `given`: one JSON value per completion of the scoring."""
        if not isinstance(column, str) or not column:
            raise RewardLogError(
                f"reward function {function} called log_extra with column {column!r}; a "
                "column's name is a non-empty string"
            )
        values = per_completion(given)
        if values is None:
            raise RewardLogError(
                f"reward function {function} logged column '{column}' as "
                f"{type(given).__name__}; log_extra takes a list, one value per completion "
                f"({self.count})"
            )
        if len(values) != self.count:
            raise RewardLogError(
                f"reward function {function} logged {len(values)} values in column '{column}' "
                f"for {self.count} completions; log one value per completion"
            )
        if column in self.extras:
            raise RewardLogError(
                f"column '{column}' was logged twice in one batch (the second time by reward "
                f"function {function}); each column is logged once per batch"
            )
        self.extras[column] = [_json_value(function, column, value) for value in values]


def per_completion(values) -> list | None:
    """A reward function's per-completion values as a list (a tensor's too); None for what
    is not a sequence of them (a string, a dict, a number)."""
    if isinstance(values, Tensor):
        values = values.tolist()
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        return None
    return list(values)


def _is_scalar(value) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1
    return type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()


def _scalar_item(value):
    """json.dumps' fallback: a NumPy or tensor scalar's Python number; TypeError otherwise."""
    if _is_scalar(value):
        return value.item()
    raise TypeError(type(value).__name__)


def real_number(value) -> float | None:
    """A real number (a Python, NumPy or one-element tensor scalar) as a float, else None."""
    if isinstance(value, Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _json_value(function: str, column: str, value):
    """`value` as JSON holds it: NumPy and tensor scalars as numbers, NaN as null."""
    if _is_scalar(value):
        value = value.item()  # a NumPy or one-element tensor scalar: its Python number
    if value is None or isinstance(value, str | bool):
        return value
    number = real_number(value)
    if number is not None:
        if isinstance(value, numbers.Integral):
            return int(value)
        return None if math.isnan(number) or math.isinf(number) else number
    try:  # a list or dict: its NumPy and tensor scalars as numbers too
        return json.loads(json.dumps(value, allow_nan=False, default=_scalar_item))
    except (TypeError, ValueError):
        raise RewardLogError(
            f"reward function {function} logged {value!r:.80} ({type(value).__name__}) in "
            f"column '{column}'; a logged value is a string, finite number, bool, None, or a list or "
            "dict of them"
        ) from None
