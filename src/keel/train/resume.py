"""Deciding whether, and from where, a run resumes, and refusing a checkpoint of another run.

A checkpoint's meta.json records what makes it *this* run: the model (its path and a hash of
its config.json), the method and its settings, the stage, the precision, the global batch and
the data fingerprint. Resuming with any of them changed would either fail deep inside the
sharded loader or, worse, silently continue a different run; instead the difference is an
error naming the config key, the checkpoint's value and this run's value, and the fix.
meta.json also holds the whole config: any other key that differs, outside the ones a resume
may change (keel.train.config_diff.RESUMABLE), is named the same way.

A finished run is never resumed silently: with train.resume=auto, output.overwrite=true
replaces it, a higher train.max_steps (or train.epochs) extends it, and otherwise keel exits 2
saying it finished and how to start over or extend it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.config import RunConfig, config_to_dict
from keel.config.schema import PREFERENCE_STAGES
from keel.errors import CheckpointError
from keel.models.hub import hub_source
from keel.train import checkpoint as ckpt
from keel.train.config_diff import config_differences
from keel.train.output_folder import FINAL_SUMMARY

START_OVER = (
    "start over: set train.resume=never and output.overwrite=true (replaces the run in "
    "output.dir), or choose a new output.dir"
)


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must share with the run that resumes it (stored in meta.json)."""

    model_path: str  # the resolved model directory
    model_config_sha256: str  # of its config.json
    method: dict  # method.type and the settings of that method
    stage: str
    precision: str  # the precision actually used (after auto)
    data_fingerprint: str
    preference: dict = dataclasses.field(default_factory=dict)  # preference stages' settings
    # train.optimizer: another optimizer's state does not load into this one (checkpoints
    # written before the setting existed hold AdamW's)
    optimizer: str = "adamw"
    # the commit sha of a Hugging Face Hub model.path ("" for a local folder, as checkpoints
    # written before Hub ids were accepted record it)
    model_revision: str = ""

    def to_meta(self) -> dict:
        return {"run": dataclasses.asdict(self)}


def run_identity(
    cfg: RunConfig, model_dir: Path, precision: str, data_fingerprint: str
) -> RunIdentity:
    config_bytes = (Path(model_dir) / "config.json").read_bytes()
    method = {"type": cfg.method.type}
    if cfg.method.uses_lora:
        method["lora"] = dataclasses.asdict(cfg.method.lora)
    if cfg.method.type in ("freeze", "qlora"):
        method[cfg.method.type] = dataclasses.asdict(getattr(cfg.method, cfg.method.type))
    return RunIdentity(
        model_path=str(Path(model_dir).resolve()),
        model_config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        method=method,
        stage=cfg.train.stage,
        precision=precision,
        data_fingerprint=data_fingerprint,
        optimizer=cfg.train.optimizer,
        model_revision=hub.commit if (hub := hub_source(model_dir)) else "",
        preference=(
            dataclasses.asdict(cfg.preference) if cfg.train.stage in PREFERENCE_STAGES else {}
        ),
    )


# meta.json field -> (config key users change, what the value is)
_KEYS = {
    "model_path": ("model.path", "the model directory"),
    "model_config_sha256": ("model.path", "the sha256 of the model's config.json"),
    "stage": ("train.stage", "the stage"),
    "precision": ("train.precision", "the compute precision"),
    "data_fingerprint": ("data", "the fingerprint of the data files and data settings"),
    "optimizer": ("train.optimizer", "the optimizer (its state is in the checkpoint)"),
    "model_revision": ("model.revision", "the Hub commit of the model"),
}
_DEFAULTS = {"optimizer": "adamw", "model_revision": ""}  # fields older checkpoints do not record


def identity_differences(saved: dict, current: RunIdentity) -> list[tuple[str, str]]:
    """(config key, line) per difference between a checkpoint's identity and this run's."""
    now = dataclasses.asdict(current)
    problems = []
    for field, value in now.items():
        old = saved.get(field, _DEFAULTS.get(field))
        if field == "method" and (old or {}).get("type") != value["type"]:
            problems.append(
                (
                    "method.type",
                    f"method.type was {(old or {}).get('type')!r} in the checkpoint, "
                    f"this run has {value['type']!r}",
                )
            )
        elif field == "method":
            problems += _method_differences(old or {}, value)
        elif field == "preference":
            problems += _method_differences(old or {}, value, "preference")
        elif old != value:
            key, what = _KEYS[field]
            problems.append(
                (key, f"{key}: {what} was {old!r} in the checkpoint, this run has {value!r}")
            )
    return problems


def _method_differences(old: dict, new: dict, prefix: str = "method") -> list[tuple[str, str]]:
    out = []
    for name in sorted(set(old) | set(new)):
        key = f"{prefix}.{name}"
        a, b = old.get(name), new.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _method_differences(a, b, key)
        elif a != b:
            out.append((key, f"{key} was {a!r} in the checkpoint, this run has {b!r}"))
    return out


def run_differences(meta: dict, identity: RunIdentity, cfg: RunConfig) -> list[str]:
    """Why checkpoint `meta` is not this run's: the identity's differences, then every other
    config key that may not change on resume (checkpoints of older keels hold no config).
    A data key that changed is named instead of the data fingerprint it changed."""
    named = identity_differences(meta.get("run", {}), identity)
    keys = {key for key, _ in named}
    changed = [
        (key, line)
        for key, line in config_differences(meta.get("config") or {}, config_to_dict(cfg))
        if key not in keys
    ]
    if any(key.startswith("data.") for key, _ in changed):
        named = [(key, line) for key, line in named if key != "data"]
    return [line for _, line in named + changed]


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
        found = ckpt.complete_checkpoints(out)
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
    meta = ckpt.verify_checkpoint(chosen)  # refuses an edited checkpoint
    saved_batch, total = meta["global_batch"], steps_for(meta["global_batch"])
    if finished_at is not None and total <= finished_at:
        raise CheckpointError(_finished_message(out, finished_at, total))
    _refuse_another_run(chosen, meta, identity, cfg, global_batch)
    ckpt.check_step_within(chosen, meta["step"], total)
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
    if type(steps) is int and newest.name == f"step-{steps:08d}":
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
