"""Deciding whether, and from where, a run resumes: the trainer's policy over checkpoints.

What a checkpoint is, and whether it is intact and this run's, is keel.checkpoint's
(layout, verify, identity); this module decides what to do with the output folder's
checkpoints under train.resume and output.overwrite, which depends on the run's length and
on whether it finished (keel_run.json, a train/ output), so it stays with the trainer.

A finished run is never resumed silently: with train.resume=auto, output.overwrite=true
replaces it, a higher train.max_steps (or train.epochs) extends it, and otherwise keel exits 2
saying it finished and how to start over or extend it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.checkpoint.identity import RunIdentity, run_differences
from keel.checkpoint.layout import complete_checkpoints, step_dir_name
from keel.checkpoint.verify import check_step_within, verify_checkpoint
from keel.config import RunConfig
from keel.errors import CheckpointError
from keel.train.output_folder import FINAL_SUMMARY

START_OVER = (
    "start over: set train.resume=never and output.overwrite=true (replaces the run in "
    "output.dir), or choose a new output.dir"
)


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Path
    global_batch: int  # the checkpoint's: a resumed run keeps its batch
    step: int  # optimizer steps the checkpoint holds (checked against its files)
    total_steps: int | None = None  # the checkpoint's run length (None: an older keel's)


def find_resume_point(
    cfg: RunConfig,
    out: Path,
    identity: RunIdentity,
    global_batch: int,
    steps_for: Callable[[int], int],
    log: Callable[[str], None],
) -> ResumePoint | None:
    """The checkpoint to resume (None: start fresh), after checking it is this run's.

    `global_batch` is what this config gives. When train.global_batch_size is unset, the
    default depends on the number of processes, and the checkpoint's global batch decides
    (so a run resumes on any number of processes); an explicit value must match it.
    `steps_for(global_batch)` is this config's number of steps.

    A finished run (keel_run.json at the newest checkpoint's step) is never continued
    silently under train.resume=auto: output.overwrite=true replaces it (None), a higher
    step count extends it (logged), and anything else is refused.
    """
    if cfg.train.resume == "never":
        return None
    if cfg.train.resume != "auto":
        chosen, finished_at = Path(cfg.train.resume), None
    else:
        found = complete_checkpoints(out)
        if not found:
            return None
        chosen, finished_at = found[-1], _finished_step(out, found[-1])
    if finished_at is not None and cfg.output.overwrite:
        log(
            f"output.overwrite: the run in {out} finished at step {finished_at}; replacing it "
            f"with a new run from step 0 (to train it further instead, set "
            f"output.overwrite=false and raise train.max_steps)"
        )
        return None
    meta = verify_checkpoint(chosen)  # refuses an edited checkpoint
    saved_batch, total = meta["global_batch"], steps_for(meta["global_batch"])
    if finished_at is not None and total <= finished_at:
        raise CheckpointError(_finished_message(out, finished_at, total))
    _refuse_another_run(chosen, meta, identity, cfg, global_batch)
    check_step_within(chosen, meta["step"], total)
    if finished_at is not None:
        log(
            f"resume: extending the run in {out}, which finished at step {finished_at}, to "
            f"{total} steps"
        )
    if saved_batch != global_batch:
        log(
            f"resume: keeping the checkpoint's global batch of {saved_batch} rows (this "
            f"config's default, micro_batch_size x grad_accum x processes, is {global_batch}); "
            f"set train.global_batch_size={saved_batch} to say so explicitly"
        )
    return ResumePoint(chosen, saved_batch, meta["step"], meta.get("total_steps"))


def _refuse_another_run(
    chosen: Path, meta: dict, identity: RunIdentity, cfg: RunConfig, global_batch: int
) -> None:
    problems = run_differences(meta, identity, cfg)
    saved_batch = meta["global_batch"]
    if saved_batch != global_batch and cfg.train.global_batch_size is not None:
        problems.append(
            f"train.global_batch_size was {saved_batch} in the checkpoint, this "
            f"run has {global_batch}; set train.global_batch_size={saved_batch} to "
            f"continue it (any number of processes works)"
        )
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(
            f"{chosen} is a checkpoint of a different run, so it cannot be resumed:\n{listed}\n"
            f"Restore those settings to continue it, or {START_OVER}"
        )


def _finished_step(out: Path, newest: Path) -> int | None:
    """The step the run in `out` finished at, when its newest checkpoint is that step's
    (None: no finished run, or one being extended that stopped before its new end)."""
    try:
        steps = json.loads((out / FINAL_SUMMARY).read_text(encoding="utf-8")).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    if type(steps) is int and newest.name == step_dir_name(steps):
        return steps
    return None


def _finished_message(out: Path, finished_at: int, total: int) -> str:
    return (
        f"output.dir {out} holds a run that finished at step {finished_at} (its model and "
        f"keel_run.json are there), and this config's {total} steps leave nothing to train. "
        f"To start over with this config, set output.overwrite=true (it replaces keel's files "
        f"in {out}) or choose a new output.dir; to train the finished run further, raise "
        f"train.max_steps (or train.epochs) past {finished_at} steps"
    )
