"""A Hugging Face Hub cache laid out exactly as huggingface_hub lays it out, built offline.

<cache>/models--owner--name/ (datasets--owner--name/ for a dataset repo)
    blobs/<hash>                   the file contents (git blob sha1, or sha256 for weights)
    refs/<revision>                the commit sha a branch or tag points at (no newline)
    snapshots/<commit>/<file>  ->  ../../blobs/<hash> (relative symlinks)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from cli_support import keel, keel_commands

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits, as the Hub's commits


def _blob_name(data: bytes, path: Path) -> str:
    if path.suffix in (".safetensors", ".parquet"):  # LFS files are stored under their sha256
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # the git blob id


def add_snapshot(
    cache: Path,
    repo_id: str,
    source: Path,
    *,
    commit: str = COMMIT,
    ref: str | None = "main",
    repo_type: str = "model",
) -> Path:
    """Put every file of the folder `source` into `cache` as commit `commit` of `repo_id`
    (and point `ref` at it); returns the snapshot folder. repo_type: model or dataset."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / _blob_name(data, file)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    """Environment for a subprocess that must never reach the network."""
    return {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def keel_offline(*args: str, hf_home: Path):
    """The real `keel` command with `hf_home` as its Hugging Face home, offline."""
    return keel(*args, env=offline_env(hf_home))


def keel_offline_commands(*commands: list[str], hf_home: Path):
    """`commands` (keel argvs) one after another in one new interpreter with `hf_home` as
    its Hugging Face home, offline (set before huggingface_hub is imported, as for a user)."""
    return keel_commands(*commands, env=offline_env(hf_home))
