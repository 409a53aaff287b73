"""How often a run evaluates and saves, counted per epoch (train.evals_per_epoch,
output.saves_per_epoch) as Axolotl's evals_per_epoch and saves_per_epoch count them.

A count per epoch needs the number of steps in an epoch, known once the data is read and the
global batch decided: the run then turns it into train.eval_every and output.save_every
steps, ceil(steps per epoch / count), as Hugging Face rounds its fractional eval_steps and
save_steps (a fraction of the run's steps) up, and the log says how many steps that is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from keel.config import RunConfig


def per_epoch_cadence(
    cfg: RunConfig, steps_per_epoch: int, log: Callable[[str], None]
) -> RunConfig:
    """`cfg` with its per-epoch counts turned into steps (unchanged without any)."""
    train, output = cfg.train, cfg.output
    if train.evals_per_epoch:
        every = math.ceil(steps_per_epoch / train.evals_per_epoch)
        train = replace(train, eval_every=every)
        log(
            _line(
                "evaluation", every, train.evals_per_epoch, "train.evals_per_epoch", steps_per_epoch
            )
        )
    if output.saves_per_epoch:
        every = math.ceil(steps_per_epoch / output.saves_per_epoch)
        output = replace(output, save_every=every)
        log(
            _line(
                "checkpoint",
                every,
                output.saves_per_epoch,
                "output.saves_per_epoch",
                steps_per_epoch,
            )
        )
    return replace(cfg, train=train, output=output)


def _line(what: str, every: int, count: int, key: str, steps_per_epoch: int) -> str:
    return f"{what}s: every {every} steps ({key} {count} of {steps_per_epoch} steps per epoch)"
