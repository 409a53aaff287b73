"""Training checkpoints as a source of weights outside training (`keel export`).

A checkpoint (see keel.checkpoint.layout) stores the *trainable* weights
only: the LoRA adapter of a LoRA run, every weight of a full run, the trained layers of a
freeze run. meta.json records the model the run trained and its method, so the model the
weights belong to is rebuilt here: the base, with the same method applied, then the stored
weights copied in. The stored keys carry the prefix of the module training saved (the
loss wrapper around the model); it is found by matching, not assumed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from keel.checkpoint.dcp import UnsafeCheckpointError, load_model_tensors, stored_model_shapes
from keel.checkpoint.layout import (
    CHECKPOINTS,
    FORMAT_VERSION,
    META,
    STATE_DIR,
    complete_checkpoints,
    looks_like_step_dir,
)
from keel.config.schema import (
    FreezeConfig,
    LoraConfig,
    MethodConfig,
    ModelConfig,
    OftConfig,
    QatConfig,
    QloraConfig,
    VisionConfig,
)
from keel.errors import CheckpointError, ModelError
from keel.models.adapters import apply_method
from keel.models.vocabulary import embedding_names, with_trained_embeddings


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A complete keel checkpoint folder and what its meta.json says about the run."""

    path: Path
    step: int
    base: str | None  # the model directory the run trained
    method: MethodConfig
    # model.vision of the run (which tower/projector parts trained); the defaults for
    # checkpoints written before the section existed, or by text-model runs
    vision: VisionConfig = field(default_factory=VisionConfig)
    # model.add_tokens and model.add_special_tokens of the run (keel.models.vocabulary)
    added_tokens: ModelConfig | None = None

    def describe(self) -> str:
        return f"checkpoint {self.path} (step {self.step}, method {self.method.type})"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` looks like a checkpoints/step-N folder (complete or not)."""
    return (path / META).is_file() or looks_like_step_dir(path)


def refuse_unfinished_run(path: Path, flag: str) -> None:
    """Refuse, with the checkpoint to use instead, an output.dir whose run wrote no final
    model yet, its checkpoints/ folder, or an interrupted checkpoint save."""
    if looks_like_step_dir(path) and not (path / META).is_file():
        run = path.parent.parent
        raise CheckpointError(
            f"{flag} {path} is an incomplete checkpoint (its save was interrupted, no "
            f"{META}); {_latest_hint(run, flag)}"
        )
    if path.name == CHECKPOINTS and path.is_dir():
        raise CheckpointError(f"{flag} {path} holds checkpoints; {_latest_hint(path.parent, flag)}")
    has_model = (path / "config.json").is_file() or (path / "adapter_config.json").is_file()
    if (path / CHECKPOINTS).is_dir() and not has_model:
        raise CheckpointError(
            f"{flag} {path} holds no final model (its run has not finished); "
            f"{_latest_hint(path, flag)}"
        )


def _latest_hint(run: Path, flag: str) -> str:
    found = complete_checkpoints(run)
    if not found:
        return f"{run} has no complete checkpoint to export"
    return f"export its newest complete checkpoint: {flag} {found[-1]}"


def read_checkpoint(path: Path) -> TrainingCheckpoint:
    """The checkpoint at `path`; CheckpointError unless keel can read it."""
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path / META} cannot be read ({exc}); the checkpoint is damaged"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format", 1) if isinstance(meta, dict) else "?"
        raise CheckpointError(
            f"{path} is checkpoint format {found}; this keel exports format {FORMAT_VERSION} "
            f"only (no pickled objects). Export the run's final output.dir instead, or "
            f"export with the keel that wrote it"
        )
    if not (path / STATE_DIR).is_dir():
        raise CheckpointError(f"{path} has no {STATE_DIR}/ folder: the checkpoint is damaged")
    run = meta.get("run") or {}
    return TrainingCheckpoint(
        path=path,
        step=int(meta.get("step", 0)),
        base=run.get("model_path"),
        method=_method_of(run.get("method") or {}, path),
        vision=_vision_of(meta.get("config") or {}, path),
        added_tokens=_added_tokens_of(meta.get("config") or {}),
    )


def _added_tokens_of(config: dict) -> ModelConfig | None:
    model = config.get("model") or {}
    plain, special = model.get("add_tokens") or [], model.get("add_special_tokens") or []
    if not plain and not special:
        return None
    return ModelConfig(path=model.get("path", ""), add_tokens=plain, add_special_tokens=special)


def _vision_of(config: dict, path: Path) -> VisionConfig:
    saved = (config.get("model") or {}).get("vision") or {}
    try:
        return VisionConfig(**saved)
    except TypeError:
        raise CheckpointError(
            f"{path / META} records a model.vision section keel does not know ({saved!r}); "
            f"export with the keel that wrote the checkpoint"
        ) from None


def _method_of(saved: dict, path: Path) -> MethodConfig:
    try:
        kind = saved["type"]
        if kind == "lora":
            return MethodConfig(type=kind, lora=LoraConfig(**saved["lora"]))
        if kind == "qlora":  # exported onto the full-precision base, as LoRA
            return MethodConfig(
                type=kind, lora=LoraConfig(**saved["lora"]), qlora=QloraConfig(**saved["qlora"])
            )
        if kind == "oft":
            return MethodConfig(type=kind, oft=OftConfig(**saved["oft"]))
        qat = QatConfig(**saved.get("qat", {}))  # none in checkpoints from before QAT
        if kind == "freeze":
            return MethodConfig(type=kind, freeze=FreezeConfig(**saved["freeze"]), qat=qat)
        if kind == "full":
            return MethodConfig(type=kind, qat=qat)
    except (KeyError, TypeError):
        pass
    raise CheckpointError(
        f"{path / META} records no method keel knows ({saved!r}); the checkpoint is damaged "
        f"or from another keel version"
    )


def load_checkpoint_weights(
    model, checkpoint: TrainingCheckpoint, base_dir: Path, log: Callable[[str], None]
):
    """`model` (the base) with the checkpoint's method applied and its weights loaded in.

    Returns the model to merge or save: a PeftModel for LoRA and OFT, `model` itself otherwise.
    Every trained weight must be in the checkpoint with the model's shape; anything else
    is a ModelError naming the base and the fix.
    """
    fix = f"pass the model the run trained ({checkpoint.base}) as --model"
    state_dir = checkpoint.path / STATE_DIR
    try:
        stored = stored_model_shapes(state_dir)
    except (UnsafeCheckpointError, ValueError) as exc:
        raise CheckpointError(f"cannot read {checkpoint.path}: {exc}") from None
    quiet = lambda _message: None  # noqa: E731
    method = checkpoint.method
    if checkpoint.added_tokens is not None and _holds_embeddings(model, stored):
        method = with_trained_embeddings(model, method, quiet)  # as the run trained them
    try:
        model = apply_method(model, method, log=quiet, vision=checkpoint.vision)
    except ModelError as exc:
        raise ModelError(
            f"{checkpoint.path} does not fit the base model {base_dir}: {exc}; {fix}"
        ) from None
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    prefix = _saved_prefix(list(trained), stored)
    problems = _shape_problems(model, trained, stored, prefix)
    if problems:
        raise ModelError(
            f"{checkpoint.path} does not fit the base model {base_dir}: "
            f"{'; '.join(problems)}; {fix}"
        )
    try:
        load_model_tensors(state_dir, {prefix + n: p.detach() for n, p in trained.items()})
    except (UnsafeCheckpointError, ValueError) as exc:
        raise CheckpointError(f"cannot read {checkpoint.path}: {exc}") from None
    log(f"loaded {len(trained)} trained tensors from {checkpoint.path}")
    return model.eval()


def _holds_embeddings(model, stored: dict[str, tuple[int, ...]]) -> bool:
    """Whether the checkpoint trained the input embeddings (a run whose added tokens were
    new to the vocabulary trains them beside its method's weights)."""
    name = embedding_names(model)[0]
    return any(f"{name}.weight" in key or f"{name}.modules_to_save." in key for key in stored)


def _saved_prefix(names: list[str], stored: dict[str, tuple[int, ...]]) -> str:
    """The prefix training's saved module put before the model's parameter names."""
    if not names:
        return ""
    first = names[0]
    candidates = {key[: len(key) - len(first)] for key in stored if key.endswith(first)}
    candidates = {c for c in candidates if not c or c.endswith(".")}
    return max(candidates, key=lambda c: sum(c + n in stored for n in names), default="")


def _shape_problems(model, trained: dict, stored: dict, prefix: str) -> list[str]:
    missing = [n for n in trained if prefix + n not in stored]
    reshaped = [
        f"{n} is {stored[prefix + n]} there, {tuple(p.shape)} here"
        for n, p in trained.items()
        if prefix + n in stored and stored[prefix + n] != tuple(p.shape)
    ]
    known = {prefix + name for name in model.state_dict()}  # tied names and buffers too
    unexpected = [key.removeprefix(prefix) for key in stored if key not in known]
    problems = []
    for what, names in (
        ("trained weight(s) not in the checkpoint", missing),
        ("weight(s) of another shape", reshaped),
        ("stored weight(s) the base has no place for", unexpected),
    ):
        if names:
            problems.append(f"{len(names)} {what} (e.g. {', '.join(names[:2])})")
    return problems
