"""Sources: resolve `data.datasets` entries to local files and load them with `datasets`.

A source is a JSON (array) / JSONL / CSV / Parquet / .txt file, a folder of such files, a
directory written by `Dataset.save_to_disk`, or a name in LLaMA-Factory's
`dataset_info.json`. Each file becomes one `SourceUnit` so the report can name the file and
row of every problem. When `datasets` cannot parse a JSON file, Python's json re-reads it to
report each bad line (or, for a JSON array, the line and column of the syntax error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from keel.config.schema import DataConfig, DatasetConfig
from keel.data.dataset_info import load_dataset_info, resolve_entry, unknown_name_error
from keel.data.formats import FORMATS, check_overrides
from keel.data.report import Rejection
from keel.errors import DataError

LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_SAVED_MARKERS = ("state.json", "dataset_dict.json")  # written by save_to_disk


@dataclass
class Source:
    """One entry of `data.datasets`, resolved to local files."""

    config: DatasetConfig
    label: str  # how messages name it: the path relative to base_dir when possible
    path: Path
    files: list[Path]  # data files; for a saved dir, every file in it (for the fingerprint)
    saved: bool  # a `save_to_disk` directory
    format: str  # auto or one of FORMATS
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    split: str = "train"
    entry: dict | None = None  # the dataset_info.json entry, as written


@dataclass
class SourceUnit:
    """The rows of one file. `rows`/`lines` give 1-based numbers when not simply i + 1."""

    file: str
    dataset: object | None  # datasets.Dataset, or None when nothing could be read
    read: int
    rows: list[int] | None = None
    lines: list[int] | None = None
    rejections: list[Rejection] = field(default_factory=list)

    def row_of(self, i: int) -> tuple[int, int | None]:
        row = self.rows[i] if self.rows is not None else i + 1
        return row, (self.lines[i] if self.lines is not None else None)


def _label(path: Path, base_dir: Path) -> str:
    try:
        return str(path.relative_to(base_dir))
    except ValueError:
        return str(path)


def resolve_sources(cfg: DataConfig, base_dir: Path) -> list[Source]:
    """Resolve every `data.datasets` entry; all problems are DataErrors naming the entry."""
    if not cfg.datasets:
        raise DataError("data.datasets is empty; list at least one dataset file")
    dataset_dir = info = None
    if cfg.dataset_dir:
        dataset_dir = _absolute(cfg.dataset_dir, base_dir)
        info = load_dataset_info(dataset_dir)
    sources = []
    for i, dc in enumerate(cfg.datasets):
        where = f"data.datasets[{i}] ({dc.path})"
        check_overrides(dc.columns, dc.tags, where)
        if dc.format != "auto" and dc.format not in FORMATS:
            raise DataError(
                f"{where}: format '{dc.format}' is unknown; use auto or one of {FORMATS}"
            )
        if info is not None and dc.path in info:
            entry = resolve_entry(dc.path, info, dataset_dir)
            path, split = entry.path, entry.split or dc.split
            fmt = dc.format if dc.format != "auto" else entry.formatting
            columns, tags, raw = (
                {**entry.columns, **dc.columns},
                {**entry.tags, **dc.tags},
                entry.raw,
            )
        else:
            path = _absolute(dc.path, base_dir)
            if not path.exists():
                if info is not None:
                    raise unknown_name_error(dc.path, info, dataset_dir)
                raise DataError(f"{where}: file not found: {path}")
            split, fmt, columns, tags, raw = (
                dc.split,
                dc.format,
                dict(dc.columns),
                dict(dc.tags),
                None,
            )
        files, saved = _data_files(path, where)
        sources.append(
            Source(dc, _label(path, base_dir), path, files, saved, fmt, columns, tags, split, raw)
        )
    return sources


def _absolute(path: str, base_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def _data_files(path: Path, where: str) -> tuple[list[Path], bool]:
    supported = ", ".join(LOADERS)
    if path.is_file():
        if path.suffix.lower() not in LOADERS:
            raise DataError(
                f"{where}: unsupported file type '{path.suffix}'; supported: {supported}"
            )
        return [path], False
    if any((path / m).is_file() for m in _SAVED_MARKERS):
        return sorted(p for p in path.rglob("*") if p.is_file()), True
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in LOADERS
        and p.name != "dataset_info.json"
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"{where}: the folder {path} holds no data files ({supported})")
    return files, False


def load_source(src: Source, cache_dir: Path, base_dir: Path) -> list[SourceUnit]:
    """Load a source as one unit per file, reading at most `max_samples` rows in total."""
    limit = src.config.max_samples
    if src.saved:
        return [_load_saved(src, limit)]
    units = []
    for f in src.files:
        if limit is not None and limit <= 0:
            break
        unit = _load_file(f, _label(f, base_dir), cache_dir, limit)
        units.append(unit)
        if limit is not None:
            limit -= unit.read
    return units


def _load_saved(src: Source, limit: int | None) -> SourceUnit:
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(src.path))
    except Exception as e:  # a damaged directory: report it, not a traceback
        raise DataError(
            f"{src.label}: cannot be loaded with datasets.load_from_disk: {e}"
        ) from None
    if isinstance(ds, DatasetDict):
        if src.split not in ds:
            raise DataError(
                f"{src.label}: no split '{src.split}'; available: {', '.join(ds)} (set split:)"
            )
        ds = ds[src.split]
    if limit is not None and len(ds) > limit:
        ds = ds.select(range(limit))
    return SourceUnit(src.label, ds, read=len(ds))


def _load_file(path: Path, label: str, cache_dir: Path, limit: int | None) -> SourceUnit:
    from datasets import load_dataset

    kind = LOADERS[path.suffix.lower()]
    extra = {"parse_agent_traces": False} if kind == "json" else {}
    try:
        ds = load_dataset(
            kind, data_files=str(path), split="train", cache_dir=str(cache_dir / "hf"), **extra
        )
    except Exception as e:  # user data the library cannot parse: explain it, no traceback
        if kind == "json":
            return _rescan_json(path, label, limit, e)
        raise DataError(f"{label}: cannot be read as {kind}: {_short(e)}") from None
    rows = None
    if kind == "text":  # one document per line; blank lines separate, they are not documents
        nonblank = pc.not_equal(pc.utf8_length(pc.utf8_trim_whitespace(ds.data.column("text"))), 0)
        keep = np.flatnonzero(nonblank.to_numpy(zero_copy_only=False))
        ds, rows = ds.select(keep), (keep + 1).tolist()
    if limit is not None and len(ds) > limit:
        ds = ds.select(range(limit))
        rows = rows[:limit] if rows is not None else None
    return SourceUnit(label, ds, read=len(ds), rows=rows, lines=rows)


def _short(e: Exception) -> str:
    cause = e.__cause__ or e.__context__
    text = f"{e} ({cause})" if cause is not None and str(cause) not in str(e) else str(e)
    return text if len(text) < 500 else text[:500] + "..."


def _rescan_json(path: Path, label: str, limit: int | None, error: Exception) -> SourceUnit:
    """Re-read a JSON/JSONL file that `datasets` refused, finding every malformed row."""
    from datasets import Dataset

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{label}: not UTF-8 text ({e})") from None
    if not text.strip():
        return SourceUnit(label, None, read=0)
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            reason = f"malformed JSON: {e.msg} at line {e.lineno}, column {e.colno}; the whole file is unusable"
            return SourceUnit(
                label, None, read=0, rejections=[Rejection(label, None, reason, e.lineno)]
            )
        records = [(i + 1, None, rec, None) for i, rec in enumerate(data)]
    else:
        records = list(_jsonl_records(text))
    if limit is not None:
        records = records[:limit]
    good, rows, lines, rejections = [], [], [], []
    for row, line, rec, problem in records:
        if problem is None and not isinstance(rec, dict):
            problem = f"not a JSON object (got {type(rec).__name__})"
        if problem is not None:
            rejections.append(Rejection(label, row, problem, line))
        else:
            good.append(rec)
            rows.append(row)
            lines.append(line)
    if not rejections:
        raise DataError(f"{label}: cannot be loaded: {_short(error)}") from None
    ds = Dataset.from_list(good, on_mixed_types="use_json") if good else None
    has_lines = any(x is not None for x in lines)
    return SourceUnit(label, ds, len(records), rows, lines if has_lines else None, rejections)


def _jsonl_records(text: str):
    """(row, line, record, problem) for each non-blank line; problem is None when valid."""
    row = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row += 1
        try:
            yield row, lineno, json.loads(line), None
        except json.JSONDecodeError as e:
            yield row, lineno, None, f"malformed JSON: {e.msg} at column {e.colno}"
