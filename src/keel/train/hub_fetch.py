"""Fetch a Hub model once per node, before any collective waits on it.

A download can take an hour; the process group's collectives time out in minutes. So every
wait here is on the slow group (distributed.preprocess_timeout_s), and in three rounds:
rank 0 resolves model.revision to a commit (downloading it); the first process of every
other node fetches that same commit (a branch may move meanwhile; the commit does not);
then every other process finds it in its node's cache, offline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from keel.config import RunConfig
from keel.distributed.process_group import DistContext
from keel.errors import ModelError
from keel.models.hub import download_hub_model, hub_source, is_hub_id


def fetch_hub_model(cfg: RunConfig, dist: DistContext, log: Callable[[str], None]) -> Path | None:
    """The snapshot folder of a Hub `model.path` on this node; None for other model paths.

    Raises ModelError on every rank when any node could not fetch it (exit 2).
    """
    repo_id = cfg.model.path
    if not is_hub_id(repo_id):
        return None
    folder, failure = None, ""
    if dist.is_main:
        try:
            folder = download_hub_model(repo_id, cfg.model.revision, log=log)
        except ModelError as exc:
            failure = str(exc)
    # The commit, never the branch name, from here on: every node trains the same weights.
    failure, commit = dist.broadcast_object(
        (failure, hub_source(folder).commit if folder else ""), slow=True
    )
    if failure:
        raise ModelError(
            failure if dist.is_main else f"rank 0 could not fetch the model: {failure}"
        )
    if dist.local_rank == 0 and not dist.is_main:
        failure = _try(lambda: download_hub_model(repo_id, commit, log=log))
    failures = [f for f in dist.gather_objects(failure, slow=True) if f]
    if failures:
        raise ModelError(f"a node could not fetch the model: {failures[0]}")
    if folder is None:
        folder = download_hub_model(repo_id, commit, local_only=True, log=_quiet)
    log(f"model {repo_id} at commit {commit}: {folder}")
    return folder


def _try(fetch: Callable[[], Path]) -> str:
    try:
        fetch()
    except ModelError as exc:
        return str(exc)
    return ""


def _quiet(_message: str) -> None:
    pass
