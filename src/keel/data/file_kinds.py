"""Which local files keel reads as data, and with which `datasets` loader: by the file's
suffixes, through a compression suffix (the text formats may be .gz, .bz2, .xz or .zst)."""

from __future__ import annotations

from pathlib import Path

from keel.errors import DataError
from keel.files import COMPRESSIONS

LOADERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
BINARY = ("parquet", "arrow")  # formats that hold no text to check for UTF-8
# how messages list what keel reads: the text formats may be compressed too
SUPPORTED = f"{', '.join(LOADERS)} (the text ones also as .gz, .bz2, .xz or .zst)"


def loader_of(path: Path) -> str | None:
    """The `datasets` loader of a data file by its suffixes (json, csv, parquet, arrow,
    text), through a compression suffix (`a.jsonl.zst`: json); None: keel does not read
    it."""
    suffixes = [s.lower() for s in path.suffixes]
    compressed = bool(suffixes) and suffixes[-1] in COMPRESSIONS
    if compressed:
        suffixes.pop()
    kind = LOADERS.get(suffixes[-1]) if suffixes else None
    return None if compressed and kind in BINARY else kind


_SAVED_MARKERS = ("state.json", "dataset_dict.json")  # written by save_to_disk


def data_files(path: Path, where: str) -> tuple[list[Path], bool]:
    """The data files of a local path (a file, or the files of a folder keel reads, its
    hidden ones and dataset_info.json aside), and whether it is a `save_to_disk` folder
    (then all its files); `where` names the entry in errors."""
    if path.is_file():
        if loader_of(path) is None:
            raise DataError(
                f"{where}: unsupported file type '{''.join(path.suffixes[-2:])}'; supported: "
                f"{SUPPORTED}"
            )
        return [path], False
    if any((path / m).is_file() for m in _SAVED_MARKERS):
        return sorted(p for p in path.rglob("*") if p.is_file()), True
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and loader_of(p) is not None
        and p.name != "dataset_info.json"
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"{where}: the folder {path} holds no data files ({SUPPORTED})")
    return files, False
