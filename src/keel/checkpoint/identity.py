"""What makes a checkpoint *this* run's: the run identity and the config keys a resume may
change.

A checkpoint's meta.json records the run identity: the model (its path and a hash of its
config.json), the method and its settings, the stage, the precision, the optimizer, the data
fingerprint. Resuming with any of them changed would either fail deep inside the sharded
loader or, worse, silently continue a different run; instead each difference is named with
its config key, the checkpoint's value and this run's value.

meta.json also holds the whole config (`config_to_dict`). Resuming compares it with this
run's key by key: a key outside `RESUMABLE` that differs means the checkpoint belongs to
another run, and the refusal names every such key with both values (`train.lr was 0.0002 in
the checkpoint, this run has 0.0005`), instead of a fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from keel.config import RunConfig, config_to_dict
from keel.config.schema import FreezeConfig, LoraConfig
from keel.models.hub import hub_source
from keel.precision import Precision
from keel.stages.registry import STAGES, stage_sections


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must share with the run that resumes it (stored in meta.json)."""

    model_path: str  # the resolved model directory
    model_config_sha256: str  # of its config.json
    method: dict  # method.type and the settings of that method
    stage: str
    precision: str  # the precision actually used (after auto): Precision.name
    data_fingerprint: str
    # train.stage's own section (dpo: {beta: ...}); {} for a stage without settings
    stage_settings: dict = dataclasses.field(default_factory=dict)
    # train.optimizer: another optimizer's state does not load into this one (checkpoints
    # written before the setting existed hold AdamW's)
    optimizer: str = "adamw"
    # the commit sha of a Hugging Face Hub model.path ("" for a local folder, as checkpoints
    # written before Hub ids were accepted record it)
    model_revision: str = ""

    def to_meta(self) -> dict:
        return {"run": dataclasses.asdict(self)}


def run_identity(
    cfg: RunConfig, model_dir: Path, precision: Precision, data_fingerprint: str
) -> RunIdentity:
    """This run's identity: `model_dir` is the resolved model folder, `precision` the one
    in use (after auto), `data_fingerprint` the prepared data's."""
    config_bytes = (Path(model_dir) / "config.json").read_bytes()
    method = {"type": cfg.method.type}
    if cfg.method.uses_lora:
        method["lora"] = dataclasses.asdict(cfg.method.lora)
    if cfg.method.type in ("freeze", "qlora", "oft"):
        method[cfg.method.type] = dataclasses.asdict(getattr(cfg.method, cfg.method.type))
    if cfg.method.qat.scheme != "none":  # the rounding is what the weights trained under
        method["qat"] = dataclasses.asdict(cfg.method.qat)
    return RunIdentity(
        model_path=str(Path(model_dir).resolve()),
        model_config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        method=method,
        stage=cfg.train.stage,
        precision=precision.name,
        data_fingerprint=data_fingerprint,
        optimizer=cfg.train.optimizer,
        model_revision=hub.commit if (hub := hub_source(model_dir)) else "",
        stage_settings=(
            {} if (settings := cfg.stage_settings) is None else dataclasses.asdict(settings)
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
        elif field == "stage_settings":
            problems += _method_differences(_saved_settings(saved), value, current.stage)
        elif old != value:
            key, what = _KEYS[field]
            problems.append(
                (key, f"{key}: {what} was {old!r} in the checkpoint, this run has {value!r}")
            )
    return problems


def _saved_settings(saved: dict) -> dict:
    """A checkpoint's stage settings. Checkpoints written before the per-stage sections
    recorded the flat `preference:` section, every stage's knobs in one: of those, the ones
    its stage reads (each other knob held its default, as validation then demanded)."""
    if "stage_settings" in saved:
        return saved["stage_settings"]
    stage = STAGES.get(saved.get("stage"))
    knobs = stage.knobs if stage is not None else ()
    return {name: value for name, value in (saved.get("preference") or {}).items() if name in knobs}


# Method settings added after checkpoints recorded the method: a checkpoint of an older keel
# holds none of them, and ran with what is now their default.
_ADDED_LATER = {
    f"method.lora.{name}": getattr(LoraConfig(), name)
    for name in ("rslora", "plus_lr_ratio", "modules_to_save", "dora")
} | {"method.freeze.trainable_params": FreezeConfig().trainable_params}


def _method_differences(old: dict, new: dict, prefix: str = "method") -> list[tuple[str, str]]:
    out = []
    for name in sorted(set(old) | set(new)):
        key = f"{prefix}.{name}"
        a, b = old.get(name, _ADDED_LATER.get(key)), new.get(name)
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


# May differ between a checkpoint and the run resuming it: where and how often results are
# written, the process layout and its limits, the watchdog, the run's length (extension:
# see keel.train.optim.continue_schedule), the batch split (the global batch itself is checked
# on its own, so a run resumes on any number of processes), and speed or memory settings that
# leave the numbers the same. A name stands for itself and everything under it.
RESUMABLE = (
    "output",
    "distributed",
    "watchdog",
    "train.max_steps",
    "train.epochs",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.global_batch_size",
    "train.eval_every",
    "train.evals_per_epoch",
    "train.early_stopping_patience",
    "train.early_stopping_threshold",
    "train.resume",
    "train.preempt_signal",
    "train.threads",
    "train.gradient_checkpointing",
    "train.padding_free",
    "train.loss_chunk_size",
    "model.cache_dir",
    "model.attn_implementation",
    "model.trust_remote_code",
    "data.num_proc",
)
# Compared through the run identity (RunIdentity, above), which holds only the
# settings of the method and stage in use: a LoRA setting does not matter to a full run.
IDENTITY_SECTIONS = ("method", *stage_sections())


def resumable(key: str) -> bool:
    """Whether config key `key` (dotted, e.g. "output.save_every") may change on resume."""
    return any(key == name or key.startswith(f"{name}.") for name in RESUMABLE)


def config_differences(saved: dict, current: dict) -> list[tuple[str, str]]:
    """(key, line) for each key whose value differs and may not change on resume.

    Keys that only one side has (a setting added or removed between keel versions) are not
    compared: there is no value to compare with.
    """
    current = json.loads(json.dumps(current))  # as the checkpoint stored it: tuples are lists
    out = []
    for key, old, new in _differences(saved, current, ""):
        if resumable(key) or key.split(".")[0] in IDENTITY_SECTIONS:
            continue
        out.append((key, f"{key} was {old!r} in the checkpoint, this run has {new!r}"))
    return out


def _differences(old, new, key: str) -> Iterator[tuple[str, object, object]]:
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(old.keys() & new.keys()):
            yield from _differences(old[name], new[name], f"{key}.{name}" if key else name)
    elif _same_length_lists_of_dicts(old, new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from _differences(a, b, f"{key}[{index}]")
    elif old != new:
        yield key, old, new


def _same_length_lists_of_dicts(old, new) -> bool:
    return (
        isinstance(old, list)
        and isinstance(new, list)
        and len(old) == len(new)
        and all(isinstance(item, dict) for item in old + new)
    )
