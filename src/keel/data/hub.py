"""Datasets named by a Hugging Face Hub id (`owner/name`), through huggingface_hub's cache.

Why not `load_dataset("owner/name")`: in datasets 5.2 an offline call never reads the hub
cache. With HF_HUB_OFFLINE set, `dataset_module_factory` fails its Hub look-up at once
and falls back to `CachedDatasetModuleFactory`, which only finds an Arrow copy prepared by
an earlier online call (HF_DATASETS_CACHE/owner___name/<config>/<version>/<hash>), takes
the most recently modified one whatever `revision` says, and ignores a repo fetched with
`hf download owner/name --repo-type dataset`. So keel fetches the repo's data files itself
into the hub cache (HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE is honoured by huggingface_hub),
at an exact commit, then asks `datasets` which files make which split (the README's
`configs:` or its file-name patterns, as `load_dataset` would) and reads those files as it
reads local ones: UTF-8 and `data.max_row_bytes` checks, file and line in every message.
An online `load_dataset` of the same repo fills the same hub cache, so either way works.

Online, only the files the run reads are downloaded: the repo's file list and card are read
first, and the same resolution run over an empty copy of its layout says which files the
chosen configuration holds (a corpus repo holds terabytes of others: fineweb-edu's
sample-10BT is a small part of it).
"""

from __future__ import annotations

import fnmatch
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from keel.errors import DataError
from keel.hub_cache import HubRepo, fetch_snapshot

# The data files keel reads (the text ones compressed too), and the card whose `configs:`
# maps files to splits.
_TEXT = ("*.json", "*.jsonl", "*.csv", "*.txt")
DATA_PATTERNS = (
    *_TEXT,
    *(f"{text}{codec}" for text in _TEXT for codec in (".gz", ".bz2", ".xz", ".zst")),
    "*.parquet",
    "*.arrow",
    "README.md",
)


@dataclass(frozen=True)
class HubDataset:
    """A dataset repo's snapshot in the hub cache and its split files."""

    repo_id: str  # owner/name
    revision: str  # as configured: branch, tag or commit
    commit: str  # the full commit sha it resolved to
    folder: Path  # <cache>/datasets--owner--name/snapshots/<commit>
    splits: dict[str, list[Path]]  # split name -> its files, in datasets' order

    def label(self, file: Path) -> str:
        """How messages name one of its files: owner/name/data/train.jsonl."""
        return f"{self.repo_id}/{file.relative_to(self.folder).as_posix()}"


@dataclass(frozen=True)
class HubPart:
    """Which part of a dataset repo is read, as `load_dataset(name=, data_dir=)` says it:
    a configuration of its card (None: the default one) and a folder inside the repo."""

    subset: str | None = None  # `name`, LLaMA-Factory's `subset`
    folder: str | None = None  # `data_dir`, LLaMA-Factory's `folder`
    key: str = "subset"  # how the config names the subset, for messages
    # `data_files`: these files of the repo (paths or glob patterns) are its train split;
    # () reads the card's configuration
    files: tuple[str, ...] = ()


def fetch_hub_dataset(
    repo_id: str, revision: str, where: str, key: str, part: HubPart = HubPart()
) -> HubDataset:
    """The snapshot of dataset `repo_id` at `revision`, downloading what is missing
    (with huggingface_hub's progress bar) unless HF_HUB_OFFLINE is set, and the files of
    its `part`. Every failure is a DataError naming `where`, the id and the fix; `key` is
    the config entry (data.datasets.0)."""
    repo = HubRepo(repo_id, revision, kind="dataset", key=key, local="file or folder")
    # only what is read: the named files, else (online) the chosen configuration's files
    patterns = part.files or _files_to_fetch(repo, where, part) or DATA_PATTERNS
    folder = fetch_snapshot(repo, patterns, lambda message: DataError(f"{where}: {message}"))
    splits = _named_files(folder, where, part) if part.files else _split_files(folder, where, part)
    return HubDataset(repo_id, revision, folder.name, folder, splits)


def _files_to_fetch(repo: HubRepo, where: str, part: HubPart) -> tuple[str, ...] | None:
    """Online: the repo paths of the files `part` reads, and its card: the file list and
    card are fetched first, and the split resolution runs over an empty copy of the repo's
    layout. None offline (the cache holds what it holds), or when the list cannot be read
    (the snapshot fetch then says why: gated, missing, no network)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        listing, card = repo_listing(repo)
    except Exception:  # no network (httpx's errors), gated, missing: the cached snapshot
        return None  # answers, or the fetch says why, in the user's terms
    data = [p for p in listing if any(fnmatch.fnmatch(p, pat) for pat in DATA_PATTERNS)]
    with tempfile.TemporaryDirectory() as tmp:
        layout = Path(tmp)
        for name in data:
            (layout / name).parent.mkdir(parents=True, exist_ok=True)
            (layout / name).touch()
        if card is not None:
            shutil.copyfile(card, layout / "README.md")
        try:
            splits = _split_files(layout, where, part)
        except DataError as exc:  # name the repo, not the empty copy
            raise DataError(str(exc).replace(tmp, f"{repo.repo_id}@{repo.revision}")) from None
        read = [f.relative_to(layout).as_posix() for files in splits.values() for f in files]
    return (*sorted(set(read)), "README.md")


def repo_listing(repo: HubRepo) -> tuple[list[str], Path | None]:
    """The paths of every file of the dataset repo at its revision, and its card (README.md)
    fetched into the hub cache, or None when it has none."""
    from huggingface_hub import HfApi, hf_hub_download

    listing = HfApi().list_repo_files(repo.repo_id, repo_type="dataset", revision=repo.revision)
    if "README.md" not in listing:
        return listing, None
    card = hf_hub_download(repo.repo_id, "README.md", repo_type="dataset", revision=repo.revision)
    return listing, Path(card)


def _named_files(folder: Path, where: str, part: HubPart) -> dict[str, list[Path]]:
    """The train split of the files `part.files` names, in the order named (a pattern's
    matches in name order); each must match at least one file of the snapshot."""
    found: list[Path] = []
    for pattern in part.files:
        matched = sorted(p for p in folder.glob(pattern) if p.is_file())
        if not matched:
            raise DataError(f"{where}: the dataset has no file matching {pattern!r} (files)")
        found += [p for p in matched if p not in found]
    return {"train": found}


def _split_files(folder: Path, where: str, part: HubPart) -> dict[str, list[Path]]:
    """Split name -> files, as `load_dataset` would assign them (its own resolution)."""
    from datasets.load import dataset_module_factory

    if part.folder and not (folder / part.folder).is_dir():
        raise DataError(f"{where}: the dataset has no folder {part.folder!r}")
    try:
        module = dataset_module_factory(str(folder), data_dir=part.folder)
    except Exception as exc:  # an empty or unreadable repo: say which, no traceback
        raise DataError(f"{where}: no data files keel can read in {folder}: {exc}") from None
    params = module.builder_configs_parameters
    configs = {c.name: c for c in params.builder_configs or []}
    if part.subset is not None:
        if part.subset not in configs:
            raise DataError(
                f"{where}: {part.key} {part.subset!r} is not a configuration of the dataset; "
                f"it has {', '.join(map(repr, configs)) or 'none'}"
            )
        return _resolve_patterns(configs[part.subset], folder)
    name = params.default_config_name or (next(iter(configs)) if len(configs) == 1 else None)
    if name is None:
        raise DataError(
            f"{where}: the dataset has several configurations ({', '.join(configs)}) and no "
            f"default; name the one to read in {part.key}"
        )
    return _resolve_patterns(configs[name], folder)


def _resolve_patterns(config, folder: Path) -> dict[str, list[Path]]:
    """A builder config's data files: patterns (from the card's `configs:`) are resolved
    against the snapshot as the builder would (its `_resolve_data_files`)."""
    from datasets import DownloadConfig
    from datasets.data_files import DataFilesPatternsDict

    files = config.data_files
    if isinstance(files, DataFilesPatternsDict):
        base = folder / config.data_dir if config.data_dir else folder
        files = files.resolve(str(base), DownloadConfig())
    return {str(split): [Path(f) for f in paths] for split, paths in files.items()}
