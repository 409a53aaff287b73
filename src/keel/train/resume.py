"""Deciding whether, and from where, a run resumes, and refusing a checkpoint of another run.

A checkpoint's meta.json records what makes it *this* run: the model (its path and a hash of
its config.json), the method and its settings, the stage, the precision, the global batch and
the data fingerprint. Resuming with any of them changed would either fail deep inside the
sharded loader or, worse, silently continue a different run; instead the difference is an
error naming the config key, the checkpoint's value and this run's value, and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.config import RunConfig
from keel.config.schema import PREFERENCE_STAGES
from keel.errors import CheckpointError
from keel.train import checkpoint as ckpt

START_OVER = "set train.resume=never with a new output.dir (or output.overwrite=true) to start over"


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
}
_DEFAULTS = {"optimizer": "adamw"}  # fields older checkpoints do not record


def identity_differences(saved: dict, current: RunIdentity) -> list[str]:
    """One line per difference between a checkpoint's identity and this run's."""
    now = dataclasses.asdict(current)
    problems = []
    for field, value in now.items():
        old = saved.get(field, _DEFAULTS.get(field))
        if field == "method" and (old or {}).get("type") != value["type"]:
            problems.append(
                f"method.type was {(old or {}).get('type')!r} in the checkpoint, "
                f"this run has {value['type']!r}"
            )
        elif field == "method":
            problems += _method_differences(old or {}, value)
        elif field == "preference":
            problems += _method_differences(old or {}, value, "preference")
        elif old != value:
            key, what = _KEYS[field]
            problems.append(f"{key}: {what} was {old!r} in the checkpoint, this run has {value!r}")
    return problems


def _method_differences(old: dict, new: dict, prefix: str = "method") -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        key = f"{prefix}.{name}"
        a, b = old.get(name), new.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _method_differences(a, b, key)
        elif a != b:
            out.append(f"{key} was {a!r} in the checkpoint, this run has {b!r}")
    return out


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Path
    global_batch: int  # the checkpoint's: a resumed run keeps its batch
    step: int  # optimizer steps the checkpoint holds (checked against its files)


def find_resume_point(
    cfg: RunConfig, out: Path, identity: RunIdentity, global_batch: int, log: Callable[[str], None]
) -> ResumePoint | None:
    """The checkpoint to resume (None: start fresh), after checking it is this run's.

    `global_batch` is what this config gives. When train.global_batch_size is unset, the
    default depends on the number of processes, and the checkpoint's global batch decides
    (so a run resumes on any number of processes); an explicit value must match it.
    """
    if cfg.train.resume == "never":
        return None
    if cfg.train.resume != "auto":
        chosen = Path(cfg.train.resume)
    else:
        found = ckpt.complete_checkpoints(out)
        if not found:
            return None
        chosen = found[-1]
    meta = ckpt.verify_checkpoint(chosen)  # refuses an edited checkpoint
    problems = identity_differences(meta.get("run", {}), identity)
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
    if saved_batch != global_batch:
        log(
            f"resume: keeping the checkpoint's global batch of {saved_batch} rows (this "
            f"config's default, micro_batch_size x grad_accum x processes, is {global_batch}); "
            f"set train.global_batch_size={saved_batch} to say so explicitly"
        )
    return ResumePoint(checkpoint=chosen, global_batch=saved_batch, step=meta["step"])
