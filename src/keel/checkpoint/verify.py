"""Reading a checkpoint's records back, and refusing one that was edited after keel wrote it.

meta.json records the sha256 of each small file (trainer.json, rng/*, processes/*,
state/.metadata);
resuming checks them, and checks that the step in trainer.json agrees with meta.json, the
folder's name and the scheduler's counter: an edited checkpoint is refused, not believed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from keel.checkpoint.layout import (
    FORMAT_VERSION,
    META,
    PROCESS_DIR,
    RNG_DIR,
    STATE_DIR,
    TRAINER,
    step_of,
)
from keel.errors import CheckpointError

_FIX = (
    "restore the file, resume from another checkpoint (train.resume=<checkpoints/step-* folder>), "
    "or set train.resume=never to start over"
)


def read_json(path: Path) -> dict:
    """A checkpoint's JSON object at `path`; CheckpointError if missing or damaged."""
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def small_file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of trainer.json, the RNG and per-process files and DCP's index, by path
    relative to `folder`.
    The tensor shards are left out: hashing them would read a full model's bytes per save."""
    files = [folder / TRAINER, folder / STATE_DIR / ".metadata"]
    files += sorted((folder / RNG_DIR).glob("*.safetensors"))
    files += sorted((folder / PROCESS_DIR).glob("*.json"))
    return {str(f.relative_to(folder)): _sha256(f) for f in files if f.is_file()}


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
    trainer = read_json(checkpoint / TRAINER)
    step = trainer.get("step")
    records = [(META, "step", meta.get("step"))]
    named = step_of(checkpoint)
    if named is not None:
        records.append(("the folder name", checkpoint.name, named))
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
    meta = read_json(meta_path)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{checkpoint} was written by an older keel (checkpoint format "
            f"{meta.get('format', 1)}, this keel reads format {FORMAT_VERSION}, which "
            f"stores no pickled objects); it cannot be resumed. Set train.resume=never (and "
            f"output.overwrite=true, or a new output.dir) to start over"
        )
    return meta
