"""What `keel export --model/--adapter` name, resolved to local folders: a base model, a
PEFT adapter, a keel output dir, or a training checkpoint (keel.checkpoint.source)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.checkpoint.source import (
    TrainingCheckpoint,
    is_checkpoint,
    read_checkpoint,
    refuse_unfinished_run,
)
from keel.config.schema import BUNDLED_PREFIX
from keel.errors import ModelError
from keel.models.adapters import adapter_base
from keel.models.bundled import resolve_model_path
from keel.models.safetensors_files import read_checked

Log = Callable[[str], None]


@dataclass(frozen=True)
class Sources:
    """Where each part of the exported model comes from, resolved to local folders."""

    base_dir: Path
    adapter_dir: Path | None  # a PEFT adapter folder
    checkpoint: TrainingCheckpoint | None  # or a training checkpoint
    tokenizer_dir: Path


def resolve_sources(model: str, adapter: str | None, cache_dir: str | Path, log: Log) -> Sources:
    """Classify `--model` and `--adapter` and find the base model folder.

    Raises ModelError (or CheckpointError) naming the flag, the path and the fix.
    """
    model_dir = None if model.startswith(BUNDLED_PREFIX) else Path(model).expanduser()
    if model_dir is not None:
        refuse_unfinished_run(model_dir, "--model")
        if is_checkpoint(model_dir):
            _refuse_both(model, adapter, "a training checkpoint")
            checkpoint = read_checkpoint(model_dir)
            base_dir = _trained_base(checkpoint, cache_dir, log)
            return Sources(
                base_dir=base_dir, adapter_dir=None, checkpoint=checkpoint, tokenizer_dir=base_dir
            )
    adapter_dir = Path(adapter).expanduser() if adapter else None
    if adapter_dir is not None:
        refuse_unfinished_run(adapter_dir, "--adapter")
        if is_checkpoint(adapter_dir):
            checkpoint = read_checkpoint(adapter_dir)
            base_dir = resolve_model_path(model, cache_dir, log)
            return Sources(
                base_dir=base_dir, adapter_dir=None, checkpoint=checkpoint, tokenizer_dir=base_dir
            )
        _check_adapter_dir(adapter_dir)
    revision = "main"
    if model_dir is not None and (model_dir / "adapter_config.json").is_file():
        _refuse_both(model, adapter, "an adapter")
        adapter_dir = model_dir
        model, revision = adapter_base(adapter_dir)
    base_dir = resolve_model_path(model, cache_dir, log, revision=revision)
    tokenizer_dir = base_dir
    if adapter_dir is not None and (adapter_dir / "tokenizer_config.json").is_file():
        tokenizer_dir = adapter_dir  # keel saves the tokenizer it trained with beside the adapter
    return Sources(
        base_dir=base_dir, adapter_dir=adapter_dir, checkpoint=None, tokenizer_dir=tokenizer_dir
    )


def _refuse_both(model: str, adapter: str | None, what: str) -> None:
    if adapter is not None:
        raise ModelError(
            f"--model {model} is {what}, so it cannot take --adapter {adapter} as well; pass "
            f"the base model as --model with --adapter {adapter}, or drop --adapter"
        )


def _check_adapter_dir(adapter_dir: Path) -> None:
    if not adapter_dir.is_dir():
        raise ModelError(f"--adapter {adapter_dir}: no such folder")
    if not (adapter_dir / "adapter_config.json").is_file():
        full = (adapter_dir / "config.json").is_file()
        hint = (
            f"it holds a full model: export it with --model {adapter_dir} and no --adapter"
            if full
            else "give a PEFT adapter folder, the output.dir of a LoRA run, or one of its "
            "checkpoints/step-N folders"
        )
        raise ModelError(f"--adapter {adapter_dir} has no adapter_config.json; {hint}")
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise ModelError(
            f"--adapter {adapter_dir} has no adapter_model.safetensors (keel reads no pickled "
            f"weights such as adapter_model.bin); re-save the adapter with "
            f"save_pretrained(safe_serialization=True)"
        )
    read_checked(adapter_dir / "adapter_model.safetensors")  # truncated: name it, no traceback


def _trained_base(checkpoint: TrainingCheckpoint, cache_dir: str | Path, log: Log) -> Path:
    if not checkpoint.base:
        raise ModelError(
            f"{checkpoint.path} does not record its model; pass it with "
            f"--model BASE --adapter {checkpoint.path}"
        )
    if not checkpoint.base.startswith(BUNDLED_PREFIX) and not Path(checkpoint.base).is_dir():
        raise ModelError(
            f"{checkpoint.path} was trained on {checkpoint.base}, which is not there any "
            f"more; pass the base model with --model BASE --adapter {checkpoint.path}"
        )
    return resolve_model_path(checkpoint.base, cache_dir, log)
