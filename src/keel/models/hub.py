"""Models named by a Hugging Face Hub id (`owner/name`), through huggingface_hub's own cache.

The files land where every HF tool looks for them (HF_HOME / HF_HUB_CACHE), and
HF_HUB_OFFLINE is honoured by huggingface_hub itself: keel adds no switch of its own. The
resolved folder is a snapshot, `<cache>/models--owner--name/snapshots/<commit>`, so the
hub id and the exact commit can be read back from the path alone (`hub_source`): the run
identity and the adapter's base name need nothing else passed along.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.config.validate import is_hub_id
from keel.errors import ModelError
from keel.hub_cache import HubRepo, fetch_snapshot

__all__ = [
    "CONFIG_FILES",
    "MODEL_FILES",
    "HubSource",
    "download_hub_model",
    "hub_source",
    "is_hub_id",
]

# What keel reads from a model repo: config, weights (safetensors and their index), the
# tokenizer in its several formats, the chat template, generation and processor settings,
# and code for trust_remote_code. Not *.bin, *.pth, *.gguf, *.onnx: keel loads none of them.
MODEL_FILES = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "*.py",
)
# `keel plan` needs the architecture only: seconds, even for a 72B model.
CONFIG_FILES = ("config.json",)


@dataclass(frozen=True)
class HubSource:
    """Where a snapshot folder came from."""

    repo_id: str  # owner/name
    commit: str  # the full commit sha of the snapshot


def hub_source(model_dir: str | Path) -> HubSource | None:
    """The hub id and commit of a folder in a huggingface_hub cache; None for other folders.

    The cache lays a model out as `models--owner--name/snapshots/<commit>/`; a repo id never
    holds "--", so the folder name maps back to exactly one id.
    """
    snapshot = Path(model_dir)
    repo_folder = snapshot.parent.parent.name
    if snapshot.parent.name != "snapshots" or not repo_folder.startswith("models--"):
        return None
    repo_id = repo_folder.removeprefix("models--").replace("--", "/")
    return HubSource(repo_id=repo_id, commit=snapshot.name) if is_hub_id(repo_id) else None


def download_hub_model(
    repo_id: str,
    revision: str = "main",
    *,
    files: tuple[str, ...] = MODEL_FILES,
    local_only: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (branch, tag or commit).

    Downloads what is missing (huggingface_hub shows its progress bar), unless
    HF_HUB_OFFLINE is set or `local_only`: then the cache alone answers. Every failure is a
    ModelError that names the id, the revision and what to do.
    """
    from huggingface_hub import constants

    offline = local_only or constants.HF_HUB_OFFLINE
    where = "from the Hugging Face cache" if offline else "from the Hugging Face Hub"
    log(f"model {repo_id} (revision {revision}): {where} ({constants.HF_HUB_CACHE})")
    repo = HubRepo(repo_id, revision, kind="model", key="model", local="folder")
    return fetch_snapshot(repo, files, ModelError, local_only=local_only)
