"""Sources: resolve `data.datasets` entries to local files and load them with `datasets`.

A source is a JSON (array) / JSONL / CSV / Parquet / .txt file, a folder of such files, a
directory written by `Dataset.save_to_disk`, a name in LLaMA-Factory's `dataset_info.json`,
or a Hugging Face Hub dataset id whose files come from the hub cache (keel.data.hub). Each file becomes one `SourceUnit` so the report can name the file and
row of every problem. Text files must be UTF-8 (checked before `datasets` reads them, so the
error names the line and column of the first bad byte). When `datasets` cannot parse a JSON
file, Python's json re-reads it to report each bad line (or, for a JSON array, the line and
column of the syntax error).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from keel.config.schema import DataConfig, DatasetConfig
from keel.config.validate import is_hub_id
from keel.data.dataset_info import load_dataset_info, resolve_entry, unknown_name_error
from keel.data.file_kinds import BINARY, SUPPORTED, data_files, loader_of
from keel.data.formats import FORMATS, check_overrides
from keel.data.hub import HubDataset, HubPart, fetch_hub_dataset
from keel.data.report import Rejection
from keel.data.row_size import check_row_sizes
from keel.data.sampling import FILE_SPLITS, check_split, sample_indices, split_indices, split_ranges
from keel.errors import DataError
from keel.files import check_utf8, read_text

EVAL_KEY = "data.eval_datasets"


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
    split: str = "train"  # a name, optionally sliced: train[:1000]
    entry: dict | None = None  # the dataset_info.json entry, as written
    num_samples: int | None = None  # LLaMA-Factory's: draw N rows with the run's seed
    notes: list[str] = field(default_factory=list)  # logged once when the data is prepared
    hub: HubDataset | None = None  # a Hub dataset: its commit and split files
    # relative image paths are read from here: data.dataset_dir for a dataset_info.json
    # entry (as LLaMA-Factory's media_dir defaults to it), else the data file's folder
    media_dir: Path | None = None
    key: str = "data.datasets.0"  # its config key: data.datasets.N or data.eval_datasets.N

    @property
    def where(self) -> str:
        return entry_where(self.key, self.config.path)

    @property
    def held_out(self) -> bool:
        """An entry of data.eval_datasets (evaluation data of its own)."""
        return self.key.startswith(f"{EVAL_KEY}.")


def entry_where(key: str, path: str) -> str:
    """How messages name the dataset entry at config key `key`: data.datasets[N] (its path)."""
    entries, index = key.rsplit(".", 1)
    return f"{entries}[{index}] ({path})"


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


def label_of(path: Path, base_dir: Path) -> str:
    try:
        return str(path.relative_to(base_dir))
    except ValueError:
        return str(path)


def resolve_sources(
    cfg: DataConfig, base_dir: Path, *, stage: str | None = None, held_out: bool = False
) -> list[Source]:
    """Resolve every `data.datasets` entry (held_out: every `data.eval_datasets` entry,
    which may be none); all problems are DataErrors naming the entry.

    stage (pt, sft, dpo, orpo, simpo, kto) completes the checks that depend on it: a
    LLaMA-Factory entry means different text in pretraining and in SFT, and ranking or
    kto_tag entries train only their stages. None leaves them to a later call.
    """
    entries = cfg.eval_datasets if held_out else cfg.datasets
    if not entries and not held_out:
        raise DataError("data.datasets is empty; list at least one dataset file")
    dataset_dir = info = None
    if cfg.dataset_dir and entries:
        dataset_dir = _absolute(cfg.dataset_dir, base_dir)
        info = load_dataset_info(dataset_dir)
    prefix = EVAL_KEY if held_out else "data.datasets"
    return [
        _resolve(f"{prefix}.{i}", dc, base_dir, (dataset_dir, info), stage)
        for i, dc in enumerate(entries)
    ]


def _resolve(key: str, dc: DatasetConfig, base_dir: Path, listing, stage) -> Source:
    """The entry at config key `key` (data.datasets.N); `listing`: data.dataset_dir and its
    dataset_info.json (None, None without one)."""
    dataset_dir, info = listing
    where = entry_where(key, dc.path)
    check_overrides(dc.columns, dc.tags, where)
    if dc.format != "auto" and dc.format not in FORMATS:
        raise DataError(f"{where}: format '{dc.format}' is unknown; use auto or one of {FORMATS}")
    num_samples = dc.num_samples
    if info is not None and dc.path in info:
        entry = resolve_entry(dc.path, info, dataset_dir, stage=stage, config_format=dc.format)
        path, fmt, raw, notes = entry.path, entry.formatting, entry.raw, entry.notes
        # the config's own split or num_samples, when set, wins over the entry's
        split = dc.split if dc.split != "train" else entry.split or "train"
        columns, tags = {**entry.columns, **dc.columns}, {**entry.tags, **dc.tags}
        num_samples = entry.num_samples if num_samples is None else num_samples
        if entry.hub_id is not None:
            reading = _Reading(fmt, columns, tags, split, num_samples, raw, notes)
            subset = dc.subset or entry.subset
            part = HubPart(subset, entry.folder, f"{where}'s subset", tuple(dc.files))
            return _resolve_hub(key, dc, where, entry.hub_id, reading, part)
    else:
        path = _absolute(dc.path, base_dir)
        if not path.exists():
            if _hub_name(dc.path):
                reading = _Reading(
                    dc.format, dict(dc.columns), dict(dc.tags), dc.split, num_samples, None, []
                )
                part = HubPart(dc.subset, key=f"{key}.subset", files=tuple(dc.files))
                return _resolve_hub(key, dc, where, dc.path, reading, part)
            if info is not None:
                raise unknown_name_error(dc.path, info, dataset_dir)
            raise DataError(f"{where}: file not found: {path}")
        fmt, split, raw, notes = dc.format, dc.split, None, []
        columns, tags = dict(dc.columns), dict(dc.tags)
    hub_only = (
        ("revision", dc.revision, "main"),
        ("subset", dc.subset, None),
        ("files", dc.files, []),
    )
    for name, value, default in hub_only:
        if value != default:
            raise DataError(
                f"{where}: {name} = {value!r} applies to Hugging Face Hub datasets only, and "
                f"this path is local; remove {key}.{name}"
            )
    files, saved = data_files(path, where)
    if not saved:  # a saved DatasetDict's split names are checked when it is loaded
        check_split(split, FILE_SPLITS, where, "A file or a folder of files has one split. ")
    label = label_of(path, base_dir)
    media_dir = dataset_dir if raw is not None else path if path.is_dir() else path.parent
    return Source(
        dc,
        label,
        path,
        files,
        saved,
        fmt,
        columns,
        tags,
        split,
        raw,
        num_samples,
        notes,
        media_dir=media_dir,
        key=key,
    )


def _hub_name(path: str) -> bool:
    """owner/name and not a data file's name: data/train.jsonl that is missing is a typo."""
    return is_hub_id(path) and loader_of(Path(path)) is None


@dataclass(frozen=True)
class _Reading:
    """How a source's rows are read: its format, column and tag names, split, sampling, and
    the dataset_info.json entry (and notes) it came from, if any."""

    format: str
    columns: dict[str, str]
    tags: dict[str, str]
    split: str
    num_samples: int | None
    entry: dict | None
    notes: list[str]


def _resolve_hub(
    key: str, dc: DatasetConfig, where: str, repo_id: str, reading: _Reading, part: HubPart
) -> Source:
    """A Hub dataset: its snapshot in the hub cache (downloaded when missing and online)
    and the files of the splits that the reading's split names, in `part` of the repo."""
    hub = fetch_hub_dataset(repo_id, dc.revision, where, key, part)
    names, split = list(hub.splits), reading.split
    check_split(split, tuple(names), where, "")
    used = {name for name, _, _ in split_ranges(split, dict.fromkeys(names, 0), where)}
    files = [f for name in names if name in used for f in hub.splits[name]]
    for f in files:
        if loader_of(f) is None:
            raise DataError(
                f"{where}: {hub.label(f)} is a {f.suffix or 'extension-less'} file; keel "
                f"reads {SUPPORTED}: convert it, or download the data elsewhere"
            )
    of = "".join(
        f", {name} {value!r}"
        for name, value in (("subset", part.subset), ("folder", part.folder), ("files", part.files))
        if value
    )  # fmt: skip
    note = (
        f"data: {dc.path}: Hugging Face dataset {repo_id} at commit {hub.commit} (revision "
        f"{dc.revision}{of}), split {split}: {', '.join(hub.label(f) for f in files)}"
    )
    return Source(
        dc,
        dc.path,
        hub.folder,
        files,
        saved=False,
        format=reading.format,
        columns=reading.columns,
        tags=reading.tags,
        split=split,
        entry=reading.entry,
        num_samples=reading.num_samples,
        notes=[*reading.notes, note],
        hub=hub,
        media_dir=hub.folder,
        key=key,
    )


def _absolute(path: str, base_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def load_source(
    src: Source,
    cache_dir: Path,
    base_dir: Path,
    rng: np.random.RandomState | None = None,
    log: Callable[[str], None] | None = None,
    max_row_bytes: int = DataConfig.max_row_bytes,
) -> list[SourceUnit]:
    """Load a source as one unit per file and keep the rows its split, `num_samples` and
    `max_samples` select, in that order (see keel.data.sampling).

    rng draws `num_samples` rows (default: a generator seeded with 0). A text file with a
    row over `max_row_bytes` is a DataError (keel.data.row_size), found before it is parsed.
    """
    limit = src.config.max_samples
    sliced = src.split not in (src.hub.splits if src.hub else FILE_SPLITS)
    whole = src.num_samples is not None or sliced
    if src.saved:
        units = [_load_saved(src)]
    else:  # without sampling or slicing, stop reading once max_samples rows are read
        units, left = [], None if whole else limit
        for f in src.files:
            if left is not None and left <= 0:
                break
            label = src.hub.label(f) if src.hub else label_of(f, base_dir)
            units.append(_load_file(f, label, cache_dir, left, max_row_bytes))
            left = left - units[-1].read if left is not None else None
        if sliced:
            units = select_rows(units, _split_rows(src, units))
    if src.num_samples is not None:
        available = _count(units)
        rng = np.random.RandomState(0) if rng is None else rng
        units = select_rows(units, sample_indices(available, src.num_samples, rng))
        if log is not None:
            repeated = max(0, src.num_samples - available) if available else 0
            again = f", {repeated} of them drawn again" if repeated else ""
            log(f"data: {src.label}: num_samples {src.num_samples} of {available} rows{again}")
    if limit is not None and _count(units) > limit:
        units = select_rows(units, np.arange(limit))
    return units


def _split_rows(src: Source, units: list[SourceUnit]) -> np.ndarray:
    """Row positions a sliced split selects; `units` are src.files' rows, split by split."""
    if src.hub is None:
        return split_indices(src.split, _count(units), src.label)
    split_of = {f: name for name, files in src.hub.splits.items() for f in files}
    sizes, offsets, start = {}, {}, 0
    for f, unit in zip(src.files, units, strict=True):
        n = len(unit.dataset) if unit.dataset is not None else 0
        offsets.setdefault(split_of[f], start)
        sizes[split_of[f]] = sizes.get(split_of[f], 0) + n
        start += n
    ranges = split_ranges(src.split, sizes, src.label)
    return np.concatenate([offsets[name] + np.arange(a, b) for name, a, b in ranges])


def _count(units: list[SourceUnit]) -> int:
    return sum(len(u.dataset) for u in units if u.dataset is not None)


def select_rows(units: list[SourceUnit], indices: np.ndarray) -> list[SourceUnit]:
    """Keep the rows at `indices` (positions in all units' rows laid end to end; repeats
    allowed), in the given order within each unit. Rejections and `read` stay as they are."""
    out, start = [], 0
    indices = np.asarray(indices, dtype=np.int64)
    for u in units:
        n = len(u.dataset) if u.dataset is not None else 0
        local = indices[(indices >= start) & (indices < start + n)] - start
        start += n
        if u.dataset is None:
            out.append(u)
            continue
        rows = (np.asarray(u.rows)[local] if u.rows is not None else local + 1).tolist()
        lines = np.asarray(u.lines)[local].tolist() if u.lines is not None else None
        out.append(SourceUnit(u.file, u.dataset.select(local), u.read, rows, lines, u.rejections))
    return out


def _load_saved(src: Source) -> SourceUnit:
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    try:
        ds = load_from_disk(str(src.path))
    except Exception as e:  # a damaged directory: report it, not a traceback
        raise DataError(
            f"{src.label}: cannot be loaded with datasets.load_from_disk: {e}"
        ) from None
    if isinstance(ds, DatasetDict):
        if src.split in ds:
            return SourceUnit(src.label, ds[src.split], read=len(ds[src.split]))
        if "[" not in src.split and "+" not in src.split:
            raise DataError(
                f"{src.label}: no split '{src.split}'; available: {', '.join(ds)} (set split:)"
            )
        sizes = {name: len(part) for name, part in ds.items()}
        parts = [
            ds[name].select(range(a, b)) for name, a, b in split_ranges(src.split, sizes, src.label)
        ]
        ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    elif src.split not in FILE_SPLITS:  # one saved Dataset: train, or the split it came from
        sizes = {"train": len(ds), **({str(ds.split): len(ds)} if ds.split else {})}
        ranges = split_ranges(src.split, sizes, src.label)
        ds = ds.select(np.concatenate([np.arange(a, b) for _, a, b in ranges]))
    return SourceUnit(src.label, ds, read=len(ds))


def _load_file(
    path: Path, label: str, cache_dir: Path, limit: int | None, max_row_bytes: int
) -> SourceUnit:
    from datasets import load_dataset

    kind = loader_of(path)
    if kind not in BINARY:  # streamed: a multi-GB corpus is not read into memory for this
        check_utf8(path, what="data file", error=DataError, shown=label)
        check_row_sizes(path, label, kind, max_row_bytes)
    # A UTF-8 BOM is valid: the json and csv loaders drop it; the text loader would keep it
    # in the first line, so it reads with utf-8-sig (which is utf-8 without a BOM).
    extra = {"json": {"parse_agent_traces": False}, "text": {"encoding": "utf-8-sig"}}
    try:
        ds = load_dataset(
            kind,
            data_files=str(path),
            split="train",
            cache_dir=str(cache_dir / "hf"),
            **extra.get(kind, {}),
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

    text = read_text(path, what="data file", error=DataError, shown=label)
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
