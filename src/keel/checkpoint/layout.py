"""Where checkpoints live and what their files are called.

Layout of `<output.dir>/checkpoints/step-00000012/`:
  state/                      trainable weights + optimizer state, sharded
                              (torch.distributed.checkpoint, see keel.checkpoint.dcp); loads
                              into any number of processes
  trainer.json                step (= data position), the scheduler's state, fp16's loss
                              scaler's (scale, growth tracker; {} without fp16), and under
                              "parts" the state of each extra part registered with the
                              Checkpointer (absent when there is none)
  rng/rank-00000.safetensors  each process's RNG states (tensors; Python's state as metadata)
  processes/rank-00000.json   the state of each per-process part registered with the
                              Checkpointer, by part name (absent when no process had any:
                              e.g. grpo's rollout, saved only inside its num_iterations steps)
  meta.json                   what run this is (see keel.checkpoint.identity) and the sha256
                              of each small file above (trainer.json, rng/*, processes/*,
                              state/.metadata);
                              written last: a folder without it is not a checkpoint
A save in progress lives in `.tmp-step-00000012/` (see keel.checkpoint.commit); a crash
mid-save leaves only that, which is never mistaken for a checkpoint and is cleared on the
next start.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
META = "meta.json"
STATE_DIR = "state"
RNG_DIR = "rng"
PROCESS_DIR = "processes"
TRAINER = "trainer.json"
# 2: no pickles (trainer.json, RNG in safetensors) and the run identity in meta.json.
FORMAT_VERSION = 2
_TMP_PREFIX = ".tmp-"
# The one pattern of a step folder: `step-00000012`, or `.tmp-step-00000012` while saving.
_STEP_DIR = re.compile(r"^(?P<tmp>\.tmp-)?step-(?P<step>\d{8})$")


def step_dir_name(step: int) -> str:
    """The name of step `step`'s complete checkpoint folder."""
    return f"step-{step:08d}"


def tmp_dir_name(step: int) -> str:
    """The name of the folder step `step`'s checkpoint is written into before its commit."""
    return f"{_TMP_PREFIX}{step_dir_name(step)}"


def rng_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def process_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def step_of(path: Path) -> int | None:
    """The step a (committed) checkpoint folder's name says, or None if it names none."""
    found = _STEP_DIR.match(path.name)
    return int(found["step"]) if found and not found["tmp"] else None


def looks_like_step_dir(path: Path) -> bool:
    """Whether `path` is named like a step folder, committed or still being written."""
    return bool(_STEP_DIR.match(path.name))


def is_complete(path: Path) -> bool:
    """A committed step folder with its meta.json (written last)."""
    return step_of(path) is not None and (path / META).is_file()


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_of)


def newest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint (None: there is none)."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def clear_partial_checkpoints(output_dir: Path) -> list[Path]:
    """Remove leftovers of interrupted saves; returns what was removed."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    partial = [
        p
        for p in root.iterdir()
        if p.name.startswith(_TMP_PREFIX) or (step_of(p) is not None and not is_complete(p))
    ]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def prune_checkpoints(output_dir: Path, keep_last: int, keep_step: int | None = None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and `keep_step`'s (the
    best evaluation's, under early stopping)."""
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        if keep_step is None or old.name != step_dir_name(keep_step):
            shutil.rmtree(old, ignore_errors=True)
