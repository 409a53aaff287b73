"""Atomic checkpoints: write into a temporary folder, fsync, rename.

Layout of `<output.dir>/checkpoints/step-00000012/`:
  state/                      trainable weights + optimizer state, sharded
                              (torch.distributed.checkpoint); loads into any number of processes
  trainer.json                step (= data position), the scheduler's state and fp16's
                              loss scaler's (scale, growth tracker; {} without fp16)
  rng/rank-00000.safetensors  each process's RNG states (tensors; Python's state as metadata)
  meta.json                   what run this is (see keel.train.resume) and the sha256 of each
                              small file above (trainer.json, rng/*, state/.metadata); written
                              last: a folder without it is not a checkpoint
Resuming checks the step in trainer.json against meta.json, the folder's name and the
scheduler's counter, and each recorded sha256: an edited checkpoint is refused, not believed.
Nothing in a checkpoint is unpickled when it is loaded: JSON, safetensors, and DCP files read
with an allow-list (see keel.distributed.checkpoint), so a checkpoint folder from elsewhere
cannot run code.
Every process writes its part into `.tmp-step-*`; rank 0 then makes it durable and renames
it. A crash mid-save leaves only `.tmp-step-*`, which is never mistaken for a checkpoint
and is cleared on the next start. The user-facing model (PEFT adapter / HF model) is
written once, at the end of the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from keel.distributed.checkpoint import UnsafeCheckpointError, load_sharded, save_sharded
from keel.distributed.process_group import DistContext
from keel.errors import CheckpointError
from keel.files import fsync_dir, fsync_tree

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "meta.json"
STATE_DIR = "state"
RNG_DIR = "rng"
TRAINER = "trainer.json"
# 2: no pickles (trainer.json, RNG in safetensors) and the run identity in meta.json.
FORMAT_VERSION = 2


@dataclass(frozen=True)
class TrainState:
    """What, beyond weights and optimizer, a resumed run needs to continue exactly."""

    step: int  # optimizer steps done; also the data position (windows are derived from it)
    scheduler: dict
    rng: dict | None  # None when this rank has no saved RNG (resumed on more processes)
    scaler: dict = field(default_factory=dict)  # GradScaler.state_dict(); {}: none (not fp16)


def save_rng(path: Path) -> None:
    """This process's RNG states as safetensors (torch, CUDA) with Python's in the metadata."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{index}"] = state
    version, internal, gauss = random.getstate()
    python = json.dumps({"version": version, "state": list(internal), "gauss": gauss})
    save_file(tensors, str(path), metadata={"python": python})


def load_rng(path: Path) -> dict:
    """What `save_rng` wrote: {"torch": tensor, "cuda": [tensors], "python": state tuple}."""
    with safe_open(str(path), framework="pt") as handle:
        python = json.loads(handle.metadata()["python"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
    state = (python["version"], tuple(python["state"]), python["gauss"])
    return {"torch": tensors["torch"], "cuda": cuda, "python": state}


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def commit_dir(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then atomically give it its final name."""
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: dict,
    meta: dict,
    keep_last: int,
    dist: DistContext,
    scaler: dict | None = None,
) -> Path:
    """Write a complete checkpoint for `step` (every process calls this together).

    `scaler`: the loss scaler's state_dict (the same on every rank), so an fp16 run resumes
    with the scale it had."""
    root = output_dir / CHECKPOINTS
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / RNG_DIR).mkdir(parents=True)
    dist.barrier()
    save_sharded(tmp / STATE_DIR, module, optimizer)
    save_rng(tmp / RNG_DIR / f"rank-{dist.rank:05d}.safetensors")
    dist.barrier()
    if dist.is_main:
        trainer = {"step": step, "scheduler": scheduler, "scaler": scaler or {}}
        (tmp / TRAINER).write_text(json.dumps(trainer))
        meta = {**meta, "format": FORMAT_VERSION, "step": step, "sha256": _small_file_hashes(tmp)}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        if final.exists():  # a previous run died after this step's save; ours is as good
            shutil.rmtree(final)
        commit_dir(tmp, final)
        prune_checkpoints(output_dir, keep_last)
    dist.barrier()
    return final


def load_checkpoint(
    checkpoint: Path, *, module: nn.Module, optimizer: torch.optim.Optimizer, dist: DistContext
) -> TrainState:
    """Load weights and optimizer state (resharded to this run's processes) and the rest."""
    if not (checkpoint / STATE_DIR).is_dir():
        raise CheckpointError(
            f"{checkpoint} has no {STATE_DIR}/ folder: it was written by an "
            f"older keel or is damaged; set train.resume=never to start over"
        )
    try:
        load_sharded(checkpoint / STATE_DIR, module, optimizer)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(
            f"refusing to load {checkpoint}: {exc}. keel checkpoints hold tensors and plain "
            f"data only, so this one was not written by keel or was altered; nothing in it "
            f"was run. Set train.resume=never to start over"
        ) from None
    except ValueError as exc:
        raise CheckpointError(
            f"{exc}; set train.resume=never to start over, or resume from another checkpoint"
        ) from None
    trainer = _read_json(checkpoint / TRAINER)
    rng_file = checkpoint / RNG_DIR / f"rank-{dist.rank:05d}.safetensors"
    try:
        rng = load_rng(rng_file) if rng_file.is_file() else None
    except (KeyError, ValueError, OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"{rng_file} is damaged ({exc}); set train.resume=never to "
            f"start over, or resume from another checkpoint"
        ) from None
    return TrainState(
        step=trainer["step"],
        scheduler=trainer["scheduler"],
        rng=rng,
        scaler=trainer.get("scaler") or {},  # absent in checkpoints of older keels
    )


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is missing or damaged ({exc}); set train.resume=never "
            f"to start over, or resume from another checkpoint"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} should hold a JSON object; the checkpoint is damaged")
    return value


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
    partial = [
        p
        for p in root.iterdir()
        if p.name.startswith(".tmp-") or (_STEP_DIR.match(p.name) and not (p / META).is_file())
    ]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def prune_checkpoints(output_dir: Path, keep_last: int) -> None:
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _small_file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of trainer.json, the RNG files and DCP's index, by path relative to `folder`.
    The tensor shards are left out: hashing them would read a full model's bytes per save."""
    files = [folder / TRAINER, folder / STATE_DIR / ".metadata"]
    files += sorted((folder / RNG_DIR).glob("*.safetensors"))
    return {str(f.relative_to(folder)): _sha256(f) for f in files if f.is_file()}


_FIX = (
    "restore the file, resume from another checkpoint (train.resume=<checkpoints/step-* folder>), "
    "or set train.resume=never to start over"
)


def _check_hashes(checkpoint: Path, recorded: dict) -> None:
    for name, want in sorted(recorded.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:  # only the folder's own files
            raise CheckpointError(f"{checkpoint / META}: {name!r} is not a checkpoint file")
        path = checkpoint / name
        got = _sha256(path) if path.is_file() else "missing"
        if got != want:
            raise CheckpointError(
                f"{path} was changed after keel wrote it: its sha256 is {got}, {META} records "
                f"{want}; refusing to resume from it. Either {_FIX}"
            )


def _check_step(checkpoint: Path, meta: dict) -> None:
    """The step in trainer.json must agree with every other record of it."""
    trainer = _read_json(checkpoint / TRAINER)
    step = trainer.get("step")
    records = [(META, "step", meta.get("step"))]
    named = _STEP_DIR.match(checkpoint.name)
    if named:
        records.append(("the folder name", checkpoint.name, int(named.group(1))))
    scheduler = trainer.get("scheduler")
    if isinstance(scheduler, dict) and "last_epoch" in scheduler:  # LambdaLR: one per step
        records.append((TRAINER, "scheduler.last_epoch", scheduler["last_epoch"]))
    for where, field_name, value in records:
        if type(step) is not int or value != step:
            raise CheckpointError(
                f"{checkpoint / TRAINER}: step is {step!r} but {where} says {field_name} = "
                f"{value!r}; the checkpoint was edited or damaged. Either {_FIX}"
            )


def verify_checkpoint(checkpoint: Path) -> dict:
    """meta.json of `checkpoint` once its files are shown to be as keel wrote them.

    Checks the sha256 that meta.json records of each small file (checkpoints of older keels
    record none), and that trainer.json's step equals meta.json's, the folder name's and
    the scheduler's count. Raises CheckpointError naming the file, the field and the values.
    """
    meta = read_meta(checkpoint)
    hashes = meta.get("sha256") or {}
    if not isinstance(hashes, dict):
        raise CheckpointError(f"{checkpoint / META}: sha256 should be an object. Either {_FIX}")
    _check_step(checkpoint, meta)  # first: its message names the field and the values
    _check_hashes(checkpoint, hashes)
    return meta


def check_step_within(checkpoint: Path, step: int, total_steps: int) -> None:
    """A checkpoint past the run's last step would resume into training nothing."""
    if step > total_steps:
        raise CheckpointError(
            f"{checkpoint / TRAINER}: step is {step}, beyond this run's {total_steps} steps, "
            f"so resuming would train nothing. Set train.max_steps (or train.epochs) to cover "
            f"at least {step} steps, or set train.resume=never to start over"
        )


def read_meta(checkpoint: Path) -> dict:
    """meta.json of a complete checkpoint written by this checkpoint format."""
    meta_path = checkpoint / META
    if not meta_path.is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete keel checkpoint (no {META}); "
            f"point train.resume at a checkpoints/step-* folder"
        )
    meta = _read_json(meta_path)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{checkpoint} was written by an older keel (checkpoint format "
            f"{meta.get('format', 1)}, this keel reads format {FORMAT_VERSION}, which "
            f"stores no pickled objects); it cannot be resumed. Set train.resume=never (and "
            f"output.overwrite=true, or a new output.dir) to start over"
        )
    return meta
