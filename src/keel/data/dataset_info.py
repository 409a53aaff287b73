"""LLaMA-Factory's `dataset_info.json`: a registry of named datasets in `data.dataset_dir`.

The file is accepted as LLaMA-Factory writes it. An entry names a local file (`file_name`,
relative to the registry's folder) and how to read it (`formatting`, `columns`, `tags`).
keel reads local files only and trains no preference stage yet, so hub entries and
`ranking` entries are refused with the reason.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import DataError

INFO_FILE = "dataset_info.json"
_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


@dataclass
class InfoEntry:
    """A resolved `dataset_info.json` entry."""

    name: str
    path: Path  # the file or folder, absolute
    formatting: str  # alpaca or sharegpt
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    split: str | None = None
    raw: dict = field(default_factory=dict)  # the entry as written (for the cache fingerprint)


def load_dataset_info(dataset_dir: Path) -> dict[str, dict]:
    """Parse `<dataset_dir>/dataset_info.json`; a missing or malformed file is a DataError."""
    info_path = dataset_dir / INFO_FILE
    if not info_path.is_file():
        raise DataError(
            f"data.dataset_dir: {dataset_dir} has no {INFO_FILE}; point data.dataset_dir at the "
            f"folder that holds it, or remove data.dataset_dir and give file paths"
        )
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{info_path}: not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise DataError(f"{info_path}: expected an object mapping dataset names to entries")
    return info


def closest_names(name: str, names: list[str], n: int = 3) -> list[str]:
    """The registered names closest to `name` (difflib), best first."""
    return difflib.get_close_matches(name, names, n=n, cutoff=0.4)


def unknown_name_error(name: str, info: dict, dataset_dir: Path) -> DataError:
    close = closest_names(name, list(info))
    hint = f"; closest: {', '.join(close)}" if close else ""
    return DataError(
        f"data.datasets: '{name}' is neither a file under the config's folder nor a name in "
        f"{dataset_dir / INFO_FILE}{hint}"
    )


def resolve_entry(name: str, info: dict, dataset_dir: Path) -> InfoEntry:
    """Turn entry `name` into an InfoEntry, refusing what keel cannot train on."""
    entry = info[name]
    where = f"{dataset_dir / INFO_FILE} entry '{name}'"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected an object with file_name, formatting, columns")
    if entry.get("ranking"):
        raise DataError(
            f"{where} is preference data (ranking: true); it needs a preference stage "
            f"(DPO/ORPO/SimPO), which is not available in this version of keel"
        )
    if "kto_tag" in (entry.get("columns") or {}):
        raise DataError(
            f"{where} is KTO preference data (columns.kto_tag); it needs a preference stage, "
            f"which is not available in this version of keel"
        )
    file_name = entry.get("file_name")
    if not file_name:
        hub = [k for k in _HUB_KEYS if entry.get(k)]
        source = f" ({hub[0]}: {entry[hub[0]]})" if hub else ""
        raise DataError(
            f"{where} has no file_name{source}; keel reads local files only: download the "
            f'data and add "file_name" to the entry, or list the file in data.datasets'
        )
    path = dataset_dir / file_name
    if not path.exists():
        raise DataError(f"{where}: file_name '{file_name}' not found ({path})")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise DataError(
            f"{where}: formatting '{formatting}' is unknown; expected alpaca or sharegpt"
        )
    return InfoEntry(
        name=name,
        path=path,
        formatting=formatting,
        columns=dict(entry.get("columns") or {}),
        tags=dict(entry.get("tags") or {}),
        split=entry.get("split"),
        raw=entry,
    )
