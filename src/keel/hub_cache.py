"""One Hugging Face Hub repo (a model or a dataset) fetched into huggingface_hub's own cache,
and every failure said in the user's terms with the fix.

Shared by keel.models.hub and keel.data.hub, which wrap the message in their own error type;
neither package imports the other, so this piece sits beside them. HF_HUB_OFFLINE is honoured
by huggingface_hub itself: keel adds no switch of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.errors import KeelError


@dataclass(frozen=True)
class HubRepo:
    """A repo as the config named it, and how messages speak of it."""

    repo_id: str  # owner/name
    revision: str  # as configured: branch, tag or commit
    kind: str  # huggingface_hub's repo_type: "model" or "dataset"
    key: str  # the config entry whose path named it: "model", "data.datasets.0"
    local: str  # what a local path there may be: "folder", "file or folder"


def fetch_snapshot(
    repo: HubRepo,
    patterns: tuple[str, ...],
    fail: Callable[[str], KeelError],
    *,
    local_only: bool = False,
) -> Path:
    """The snapshot folder of `repo`, downloading the files matching `patterns` that are
    missing (huggingface_hub's progress bar), unless HF_HUB_OFFLINE is set or `local_only`:
    then the cache alone answers. A failure raises `fail(message)`."""
    from huggingface_hub import constants, snapshot_download

    offline = local_only or constants.HF_HUB_OFFLINE
    try:
        folder = snapshot_download(
            repo.repo_id,
            repo_type=repo.kind,
            revision=repo.revision,
            allow_patterns=list(patterns),
            local_files_only=local_only,
        )
    except (OSError, ValueError) as exc:  # huggingface_hub's errors derive from these
        raise fail(explain(exc, repo, offline)) from exc
    return Path(folder)


def explain(exc: Exception, repo: HubRepo, offline: bool) -> str:
    """What went wrong, in the user's terms, and the fix (huggingface_hub's error types)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, revision, cache = repo.repo_id, repo.revision, constants.HF_HUB_CACHE
    name = f"{repo.kind} {repo_id} (revision {revision})"
    not_local = f"is not a local {repo.local}"
    local = f"or point {repo.key}.path at a local {repo.local}"
    if isinstance(exc, GatedRepoError):
        url = "https://huggingface.co/" + ("datasets/" if repo.kind == "dataset" else "")
        return (
            f"{repo_id} is a gated {repo.kind}: accept its conditions at {url}{repo_id}, "
            f"then log in with `hf auth login` (or set HF_TOKEN)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{repo_id} {not_local}, nor a {repo.kind} on the Hugging Face Hub (or it is "
            f"private: log in with `hf auth login` or set HF_TOKEN); check the spelling, {local}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return (
            f"{repo_id} has no revision {revision!r} on the Hugging Face Hub; set "
            f"{repo.key}.revision to a branch, tag or commit sha that exists (default main)"
        )
    download = _download_command(repo)
    if isinstance(exc, IncompleteSnapshotError):
        return f"{name}: the cached copy at {cache} is incomplete ({exc}); run {download} again"
    if isinstance(exc, LocalEntryNotFoundError) and offline:
        return (
            f"{name} {not_local} and is not in the Hugging Face cache at {cache}, and "
            f"HF_HUB_OFFLINE=1 (nothing is downloaded): download it with {download} on a "
            f"machine with network (into the same HF_HOME), {local}"
        )
    if isinstance(exc, (LocalEntryNotFoundError, HfHubHTTPError, OSError)):
        return (
            f"{name} {not_local}, could not be downloaded from the Hugging Face Hub and is not "
            f"in the cache at {cache}: {str(exc).splitlines()[0]}; check the network (or "
            f"HF_ENDPOINT and proxy settings), or download it elsewhere with {download}, {local}"
        )
    if isinstance(exc, HFValidationError):
        return f"{repo.key}.path {repo_id!r} {not_local} nor a valid Hub id: {exc}"
    return f"{name}: {exc}"


def _download_command(repo: HubRepo) -> str:
    """The `hf download` command that fills the cache with exactly this repo and revision."""
    kind = "" if repo.kind == "model" else f" --repo-type {repo.kind}"
    pin = "" if repo.revision == "main" else f" --revision {repo.revision}"
    return f"`hf download {repo.repo_id}{kind}{pin}`"
