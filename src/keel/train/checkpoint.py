"""Atomic checkpoints: write into a temporary folder, fsync, rename.

Layout of `<output.dir>/checkpoints/step-00000012/`:
  state/              trainable weights + optimizer state, sharded (torch.distributed.checkpoint);
                      loads into any number of processes
  trainer.pt          step (= data position), scheduler, global batch size
  rng/rank-00000.pt   each process's RNG states
  meta.json           written last; a folder without it is not a checkpoint
Every process writes its part into `.tmp-step-*`; rank 0 then makes it durable and renames
it. A crash mid-save leaves only `.tmp-step-*`, which is never mistaken for a checkpoint
and is cleared on the next start. The user-facing model (PEFT adapter / HF model) is
written once, at the end of the run.
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
from torch import nn

from keel.distributed.checkpoint import load_sharded, save_sharded
from keel.distributed.process_group import DistContext
from keel.errors import CheckpointError

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "meta.json"
STATE_DIR = "state"
RNG_DIR = "rng"
TRAINER = "trainer.pt"


@dataclass(frozen=True)
class TrainState:
    """What, beyond weights and optimizer, a resumed run needs to continue exactly."""

    step: int  # optimizer steps done; also the data position (windows are derived from it)
    scheduler: dict
    rng: dict | None  # None when this rank has no saved RNG (resumed on more processes)


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


def save_checkpoint(output_dir: Path, step: int, *, module: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: dict, meta: dict,
                    keep_last: int, dist: DistContext) -> Path:
    """Write a complete checkpoint for `step` (every process calls this together)."""
    root = output_dir / CHECKPOINTS
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / RNG_DIR).mkdir(parents=True)
    dist.barrier()
    save_sharded(tmp / STATE_DIR, module, optimizer)
    torch.save(capture_rng(), tmp / RNG_DIR / f"rank-{dist.rank:05d}.pt")
    dist.barrier()
    if dist.is_main:
        torch.save({"step": step, "scheduler": scheduler}, tmp / TRAINER)
        (tmp / META).write_text(json.dumps({**meta, "step": step}, indent=2))
        if final.exists():  # a previous run died after this step's save; ours is as good
            shutil.rmtree(final)
        commit_dir(tmp, final)
        prune_checkpoints(output_dir, keep_last)
    dist.barrier()
    return final


def load_checkpoint(checkpoint: Path, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                    dist: DistContext) -> TrainState:
    """Load weights and optimizer state (resharded to this run's processes) and the rest."""
    if not (checkpoint / STATE_DIR).is_dir():
        raise CheckpointError(f"{checkpoint} has no {STATE_DIR}/ folder: it was written by an "
                              f"older keel or is damaged; set train.resume=never to start over")
    load_sharded(checkpoint / STATE_DIR, module, optimizer)
    raw = torch.load(checkpoint / TRAINER, map_location="cpu", weights_only=False)
    rng_file = checkpoint / RNG_DIR / f"rank-{dist.rank:05d}.pt"
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    return TrainState(step=raw["step"], scheduler=raw["scheduler"], rng=rng)


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
