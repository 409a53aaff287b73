"""The atomic commit: a checkpoint is written into a temporary folder, made durable, then
renamed to its final name, with meta.json written last.

Every process writes its part (shards, RNG) into `.tmp-step-*`; rank 0 then writes
trainer.json and meta.json (holding the sha256 of the small files), fsyncs every file and
the folder, and renames it. A crash at any point leaves either the previous checkpoints
untouched or a `.tmp-step-*` folder, which is never read as a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from keel.checkpoint.layout import FORMAT_VERSION, META, RNG_DIR, TRAINER
from keel.checkpoint.verify import small_file_hashes
from keel.files import fsync_dir, fsync_tree


def prepare_tmp(tmp: Path) -> None:
    """An empty temporary folder for a save (rank 0, before every rank writes into it)."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / RNG_DIR).mkdir(parents=True)


def commit_dir(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then atomically give it its final name."""
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def commit_checkpoint(tmp: Path, final: Path, *, step: int, trainer: dict, meta: dict) -> None:
    """Write trainer.json, then meta.json (format, step, sha256 of the small files) last,
    and commit `tmp` as `final` (rank 0, once every rank's files are in `tmp`)."""
    (tmp / TRAINER).write_text(json.dumps(trainer))
    meta = {**meta, "format": FORMAT_VERSION, "step": step, "sha256": small_file_hashes(tmp)}
    (tmp / META).write_text(json.dumps(meta, indent=2))
    if final.exists():  # a previous run died after this step's save; ours is as good
        shutil.rmtree(final)
    commit_dir(tmp, final)
