"""Call reward functions on a batch of completions, TRL's way, and check what they return."""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from keel.errors import KeelError
from keel.rewards.loading import RewardFunction
from keel.rewards.reward_log import RewardLog, RewardLogError, per_completion, real_number
from keel.rewards.text import completion_text

_SHOWN_CHARS = 200  # of a completion's text in an error message


class RewardError(KeelError):
    """A reward function raised, or returned something other than one number (or None) per
    completion; the message names the function and the sample."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL reward files read from `trainer_state`, under transformers' TrainerState
    names: where training is (to shape rewards over time), and which process this is."""

    global_step: int  # optimizer steps done
    max_steps: int = 0  # the run's optimizer steps
    epoch: float = 0.0  # passes over the prompts done, fractional
    num_train_epochs: float = 0.0
    logging_steps: int = 1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


@dataclass(kw_only=True)
class RewardInputs:
    """One batch of completions to score; every list has one entry per completion."""

    prompts: list  # str, or a list of messages (a prompt repeated for each of its samples)
    completions: list  # str, or [{"role": "assistant", "content": str}] for chat prompts
    completion_ids: list[list[int]]
    columns: dict[str, list]  # every other dataset column (answer, ...)
    where: list[str]  # for errors, e.g. "prompt 3 (row 17), sample 5"
    step: int  # passed as trainer_state.global_step
    state: TrainerState | None = None  # the rest of trainer_state (its global_step is step)


def score_rewards(
    functions: list[RewardFunction],
    inputs: RewardInputs,
    *,
    watch: Callable[[str], AbstractContextManager] | None = None,
    log: RewardLog | None = None,
) -> Tensor:
    """Scores [N, F] float32 of N completions by F reward functions; NaN where a function
    returned None (unscorable).

    Each function is called once for the whole batch, with TRL's keyword arguments:
    prompts, completions, completion_ids, every dataset column as a list, trainer_state,
    and log_metric / log_extra, which record into `log` (a throwaway one when None).
    A function without **kwargs gets only the arguments it names. Each call runs inside
    watch(f"reward {name}") when given (the trainer's watchdog phase: a function that
    never returns is a hang). A function that raises, or returns the wrong number of
    values or a non-number, is a RewardError naming the function and a sample.
    """
    count = len(inputs.completions)
    lengths = {len(inputs.prompts), len(inputs.completion_ids), len(inputs.where)}
    lengths |= {len(values) for values in inputs.columns.values()}
    assert lengths <= {count}, f"reward inputs of unequal lengths {lengths} for {count}"
    log = RewardLog(count) if log is None else log
    assert log.count == count, f"a log of {log.count} completions for {count}"
    scores = torch.empty(count, len(functions), dtype=torch.float32)
    for index, function in enumerate(functions):
        phase = watch(f"reward {function.name}") if watch is not None else nullcontext()
        with phase:
            returned = _call(function, inputs, log)
        scores[:, index] = torch.tensor(_as_floats(function, returned, inputs))
    return scores


def weighted_rewards(scores: Tensor, weights: list[float] | None = None) -> Tensor:
    """One reward per completion [N] from scores [N, F]: the weighted sum over functions,
    NaN scores left out; NaN where every function returned None (TRL's rule)."""
    weight = torch.ones(scores.shape[1]) if weights is None else torch.tensor(weights)
    total = (scores * weight.float().unsqueeze(0)).nansum(dim=1)  # [N]
    return torch.where(torch.isnan(scores).all(dim=1), float("nan"), total)


def _call(function: RewardFunction, inputs: RewardInputs, log: RewardLog):
    kwargs = _arguments(function, inputs, log)  # a missing column: a RewardError of its own
    try:
        return _invoke(function, kwargs)
    except RewardLogError:  # says what was logged wrong; no sample caused it
        raise
    except Exception as error:
        raise RewardError(_raised_message(function, inputs, error)) from error


def _invoke(function: RewardFunction, kwargs: dict):
    returned = function.call(**kwargs)
    if inspect.isawaitable(returned):  # async reward functions, as TRL allows
        returned = asyncio.run(_awaited(returned))
    return returned


async def _awaited(awaitable):
    return await awaitable


def _arguments(function: RewardFunction, inputs: RewardInputs, log: RewardLog) -> dict:
    """TRL's keyword arguments, or only those the function names when it takes no **kwargs."""
    offered = {
        **inputs.columns,
        "prompts": inputs.prompts,
        "completions": inputs.completions,
        "completion_ids": inputs.completion_ids,
        "trainer_state": replace(
            inputs.state or TrainerState(global_step=0), global_step=inputs.step
        ),
        **log.callbacks(function.name),
    }
    try:
        parameters = inspect.signature(function.call).parameters
    except (TypeError, ValueError):  # no signature to read (a C callable): offer everything
        return offered
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return offered
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [
        name
        for name, p in parameters.items()
        if p.kind in named and p.default is p.empty and name not in offered
    ]
    if missing:
        raise RewardError(
            f"reward function {function.name} needs argument(s) {', '.join(missing)}, which "
            f"no dataset column provides (it is offered: {', '.join(sorted(offered))}); add "
            "the column to the data, or give the parameter a default"
        )
    return {name: value for name, value in offered.items() if name in parameters}


def _raised_message(function: RewardFunction, inputs: RewardInputs, error: Exception) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if len(frames) > 1 else ""
    said = f"reward function {function.name} raised {type(error).__name__}: {error}{at}"
    culprit = _raising_sample(function, inputs)
    if culprit is not None:
        return f"{said}, on {_sample(inputs, culprit)} (called on it alone, it raises too)"
    first = _sample(inputs, 0) if inputs.completions else "no completions"
    return (
        f"{said}, scoring {len(inputs.completions)} completions in one call (none of them "
        f"raises alone); the first is {first}"
    )


def _raising_sample(function: RewardFunction, inputs: RewardInputs) -> int | None:
    """The first completion the function raises on when called with it alone, or None.

    A function is called once per batch, so its exception does not say which completion
    caused it; calling it again one completion at a time does. This runs only on the way to
    the error, and inside the same watched phase (a call that never returns is a hang)."""
    for index in range(len(inputs.completions)):
        try:  # what it logs on the way is thrown away
            _invoke(function, _arguments(function, _one(inputs, index), RewardLog(1)))
        except Exception:
            return index
    return None


def _one(inputs: RewardInputs, index: int) -> RewardInputs:
    """`inputs` narrowed to completion `index`: every list one entry long."""
    part = slice(index, index + 1)
    return RewardInputs(
        prompts=inputs.prompts[part],
        completions=inputs.completions[part],
        completion_ids=inputs.completion_ids[part],
        columns={name: values[part] for name, values in inputs.columns.items()},
        where=inputs.where[part],
        step=inputs.step,
        state=inputs.state,
    )


def _sample(inputs: RewardInputs, index: int) -> str:
    text = completion_text(inputs.completions[index])
    shown = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
    return f"{inputs.where[index]}: {shown!r}"


def _as_floats(function: RewardFunction, returned, inputs: RewardInputs) -> list[float]:
    """The returned values as floats (None -> NaN), or a RewardError saying what is wrong."""
    count, given = len(inputs.completions), returned
    returned = per_completion(given)
    if returned is None:
        raise RewardError(
            f"reward function {function.name} returned {type(given).__name__}, not a list; "
            f"return one float (or None) per completion ({count})"
        )
    if len(returned) != count:
        raise RewardError(
            f"reward function {function.name} returned {len(returned)} values for {count} "
            "completions; return exactly one float (or None: unscorable) per completion"
        )
    values = []
    for index, value in enumerate(returned):
        if value is None:
            values.append(math.nan)
        elif (number := real_number(value)) is not None and not math.isinf(number):
            values.append(number)  # (an infinite reward would make its group's advantages NaN)
        else:
            raise RewardError(
                f"reward function {function.name} returned {value!r} "
                f"({type(value).__name__}) for {_sample(inputs, index)}; return a finite "
                "float or None (unscorable)"
            )
    return values
