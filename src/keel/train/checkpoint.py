"""Atomic checkpoints: write into a temporary folder, fsync, rename.

Layout of `<output.dir>/checkpoints/step-00000012/`:
  model/              PEFT adapter or full HF model (safetensors), loadable by other tools
  trainer_state.pt    optimizer, scheduler, RNG states, step (= data position)
  meta.json           written last; a folder without it is not a checkpoint
A crash mid-save leaves only `.tmp-step-*`, which is never mistaken for a checkpoint and is
cleared on the next start.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from keel.errors import CheckpointError
from keel.train.objective import causal_lm_of

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "meta.json"
STATE = "trainer_state.pt"


@dataclass(frozen=True)
class TrainState:
    """What, beyond the weights, a resumed run needs to continue exactly."""

    step: int  # optimizer steps done; also the data position (windows are derived from it)
    optimizer: dict
    scheduler: dict
    rng: dict


def capture_rng() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under root (and root itself) to disk."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_dir(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then atomically give it its final name."""
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def save_checkpoint(output_dir: Path, state: TrainState, write_model, meta: dict,
                    keep_last: int) -> Path:
    """Write a complete checkpoint for `state.step`; `write_model(dir)` saves the weights."""
    root = output_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_model(tmp / "model")
    torch.save({"step": state.step, "optimizer": state.optimizer,
                "scheduler": state.scheduler, "rng": state.rng}, tmp / STATE)
    (tmp / META).write_text(json.dumps({**meta, "step": state.step}, indent=2))
    if final.exists():  # a previous run died after this step's save; ours is as good
        shutil.rmtree(final)
    commit_dir(tmp, final)
    prune_checkpoints(output_dir, keep_last)
    return final


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def clear_partial_checkpoints(output_dir: Path) -> list[Path]:
    """Remove leftovers of interrupted saves; returns what was removed."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-")
               or (_STEP_DIR.match(p.name) and not (p / META).is_file())]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def prune_checkpoints(output_dir: Path, keep_last: int) -> None:
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(checkpoint: Path) -> dict:
    meta_path = checkpoint / META
    if not meta_path.is_file():
        raise CheckpointError(f"{checkpoint} is not a complete keel checkpoint (no {META}); "
                              f"point train.resume at a checkpoints/step-* folder")
    return json.loads(meta_path.read_text())


def load_train_state(checkpoint: Path) -> TrainState:
    raw = torch.load(checkpoint / STATE, map_location="cpu", weights_only=False)
    return TrainState(step=raw["step"], optimizer=raw["optimizer"], scheduler=raw["scheduler"],
                      rng=raw["rng"])


def load_trained_weights(model: nn.Module, checkpoint: Path) -> None:
    """Copy the checkpoint's trained weights into the live model (adapter or full)."""
    model_dir = checkpoint / "model"
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapter))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise CheckpointError(f"{adapter} does not match this run's LoRA config "
                                  f"(unexpected keys such as {unexpected[:3]})")
        return
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    target = causal_lm_of(model)
    missing, unexpected = target.load_state_dict(state, strict=False)
    trainable_missing = [n for n, p in target.named_parameters()
                         if p.requires_grad and n in missing]
    if unexpected or trainable_missing:
        raise CheckpointError(f"{model_dir} does not match this model: missing "
                              f"{trainable_missing[:3]}, unexpected {unexpected[:3]}")
