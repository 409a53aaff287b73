"""Streamed training data (`data.streaming`): rows read, encoded and made as training goes.

For a corpus too large to tokenize up front or to hold in memory. `prepare_stream` checks
what it can before training: every entry resolves to files, each entry's format (from its
first row), the template. `RowStream` then reads the files in blocks of `BLOCK_ROWS` rows;
each block is encoded as prepared data is (keel.data.encode), its over-length samples
dropped, truncated or cut into pieces (data.overlength), and made into rows (packed with
data.packing; in a seeded order with data.shuffle).

The order is a pure function of the config and the files. Epoch e reads the files of every
entry in order, or with data.shuffle in an order drawn from train.seed + e; each file from its
first row. So every process reads the whole stream and takes its share of each step's rows
(keel.train.batch_source.StreamBatchSource), and a step's rows do not depend on the number
of processes. The position is a `Cursor`: a checkpoint saves it, and a resume reads only the
block it points into again, skipping the rows before that block without encoding them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from keel.data.batching import epoch_order
from keel.data.cache import fingerprint
from keel.data.detect import spec_for_stage
from keel.data.encode import KEPT, RowEncoder, resolve_overlength
from keel.data.encode_preference import encoder_for
from keel.data.file_kinds import loader_of
from keel.data.mixing import mixes
from keel.data.packing import cut_into_pieces, make_rows
from keel.data.pipeline import Encoding, empty_report, prepare_data
from keel.data.report import DataReport
from keel.data.sources import label_of, resolve_sources
from keel.data.template import resolve_template
from keel.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

    from keel.config.schema import DataConfig
    from keel.data.stream_mix import MixedRowStream

BLOCK_ROWS = 1024  # rows of a file encoded, packed and shuffled together
# a block's samples before they are cut and made into rows
UNITS = pa.schema([("input_ids", pa.list_(pa.int32())), ("targets", pa.list_(pa.int32()))])
_READ_OPTIONS = {"json": {"parse_agent_traces": False}, "text": {"encoding": "utf-8-sig"}}


@dataclass(frozen=True)
class StreamFile:
    """One data file of the stream."""

    path: Path
    label: str  # how messages name it
    source: int  # its entry in data.datasets (which encoder reads it)

    @property
    def kind(self) -> str:
        """The `datasets` builder that reads it: json, csv, parquet, arrow or text."""
        return loader_of(self.path)


@dataclass(frozen=True)
class Cursor:
    """A position in the stream: `row` rows of block `block` of the `file`-th file of epoch
    `epoch`'s order are taken."""

    epoch: int = 0
    file: int = 0
    block: int = 0
    row: int = 0


@dataclass(frozen=True)
class RowMaking:
    """How a block's samples become rows."""

    cutoff_len: int
    overlength: str  # drop, truncate, error or split (resolved, never auto)
    min_len: int  # data.min_len: shorter samples and pieces are dropped
    on_invalid: str
    packing: bool
    shuffle: bool
    seed: int
    mix: str = "concat"  # data.mix: interleave_* draws each block from every dataset
    mix_weights: tuple[float, ...] = ()


@dataclass
class StreamedData:
    """The training data of a streaming run, opened for reading with `open`."""

    files: list[StreamFile]
    encoders: list[RowEncoder]  # one per data.datasets entry
    making: RowMaking
    report: DataReport  # the settings and template (drops and skips are logged per block)
    fingerprint: str
    eval: Dataset | None = None  # data.eval_datasets, prepared whole (it is not streamed)

    @property
    def num_rows(self) -> None:
        """Training rows: not known before training (PreparedData's is a count)."""
        return None

    def longest_prompt(self) -> None:
        return None

    def open(self, log: Callable[[str], None]) -> RowStream | MixedRowStream:
        """The stream of its rows: its files one after another, or with data.mix interleave_*
        and several datasets, each block drawn from all of them (keel.data.stream_mix)."""
        if mixes(self.making.mix, len({f.source for f in self.files})):
            from keel.data.stream_mix import MixedRowStream

            return MixedRowStream(self, log)
        return RowStream(self, log)


def prepare_stream(
    cfg: DataConfig,
    tokenizer,
    *,
    stage: str,
    cache_dir: Path,
    base_dir: Path,
    seed: int,
    log: Callable[[str], None] = print,
    vision=None,
) -> StreamedData:
    """Resolve, check and fingerprint the training data of `cfg` (data.streaming) without
    reading more than each entry's first row; prepare its evaluation data (data.eval_datasets)
    whole, as a run that does not stream does (keel.data.pipeline, cached)."""
    if vision is not None:
        raise DataError(
            "data.streaming = true reads text models' data; a vision-language model's rows are "
            "prepared whole (their images decoded once): set data.streaming=false"
        )
    cfg = resolve_overlength(cfg, stage, vision)
    sources = resolve_sources(cfg, Path(base_dir), stage=stage)
    for note in (n for src in sources for n in src.notes):
        log(f"note: {note}")
    template, note = resolve_template(cfg.template, tokenizer, base_dir)
    prints = fingerprint(cfg, sources, template, tokenizer, stage, seed)
    encoding = Encoding(cfg, tokenizer, template, stage, vision, prints)
    files, encoders, templated = [], [], False
    for index, src in enumerate(sources):
        if src.saved:
            raise DataError(
                f"{src.where}: a datasets.save_to_disk folder is read whole; give its data "
                f"files (JSONL, Parquet, ...) to stream, or set data.streaming=false"
            )
        labels = [src.hub.label(f) if src.hub else label_of(f, base_dir) for f in src.files]
        found = [StreamFile(f, label, index) for f, label in zip(src.files, labels, strict=True)]
        first = next((row for f in found if (row := _first_row(f)) is not None), None)
        spec = spec_for_stage(first, src.format, src.columns, src.tags, stage, src.where)
        templated |= spec.format != "text"
        files += found
        encoders.append(encoder_for(tokenizer, encoding.settings(src, spec)))
    report = empty_report(cfg, stage)
    if templated:
        report.template = template.name
        if note:
            log(note)
    making = RowMaking(
        cutoff_len=cfg.cutoff_len,
        overlength=cfg.overlength,
        min_len=cfg.min_len,
        on_invalid=cfg.on_invalid,
        packing=cfg.packing,
        shuffle=cfg.shuffle,
        seed=seed,
        mix=cfg.mix,
        mix_weights=tuple(cfg.mix_weights),
    )
    shown = ", ".join(src.label for src in sources[:3]) + (", ..." if len(sources) > 3 else "")
    mixed = ""
    if mixes(cfg.mix, len(sources)):
        shares = ", ".join(f"{w:g}" for w in cfg.mix_weights)
        weights = f", weights {shares}" if shares else ""
        mixed = f"; each block drawn from every dataset (data.mix {cfg.mix}{weights})"
    log(
        f"data: streaming {len(files)} file(s) of {shown}: read, checked and tokenized as "
        f"training goes, in blocks of {BLOCK_ROWS} rows{mixed} (each process reads them "
        f"all and takes its share of each step)"
    )
    log(report.settings())
    held_out = None
    if cfg.eval_datasets:
        where = {"stage": stage, "cache_dir": cache_dir, "base_dir": base_dir, "seed": seed}
        held_out = prepare_data(cfg, tokenizer, **where, log=log, held_out_only=True).eval
    return StreamedData(files, encoders, making, report, prints, eval=held_out)


class RowStream:
    """The rows of a `StreamedData`, from a `Cursor` on, epoch after epoch."""

    def __init__(self, data: StreamedData, log: Callable[[str], None]):
        self.data, self.log = data, log
        self.cursor = Cursor()
        self._rows: pa.Table | None = None  # the cursor's block, made into rows
        self._reader: tuple[tuple[int, int, int], Iterator] | None = None  # next block's
        self._epoch_rows = 0  # rows the cursor's epoch has given so far

    def seek(self, cursor: Cursor) -> None:
        self.cursor, self._rows, self._reader = cursor, None, None
        self._epoch_rows = 1  # resumed inside an epoch that gave rows before

    def state(self) -> dict:
        """The position, as a checkpoint holds it."""
        return asdict(self.cursor)

    def seek_state(self, state: dict) -> None:
        if state.get("mix"):
            raise DataError(
                "the checkpoint's stream mixed its datasets (data.mix interleave_*), and this "
                "run reads them one after another; resume with its data.mix, or set "
                "train.resume=never to start over"
            )
        self.seek(Cursor(**state))

    def take(self, count: int) -> list[dict]:
        """The next `count` rows (moving on to the next epoch where the files end)."""
        out: list[dict] = []
        while len(out) < count:
            rows = self._block()
            if rows is None:  # past the file's last block
                self._next_file()
                continue
            c = self.cursor
            taken = rows.slice(c.row, count - len(out)).to_pylist()
            out += taken
            self._epoch_rows += len(taken)
            if c.row + len(taken) < rows.num_rows:
                self.cursor = replace(c, row=c.row + len(taken))
            else:  # the block is used up
                self.cursor, self._rows = replace(c, block=c.block + 1, row=0), None
        return out

    def progress(self) -> float:
        """Epochs read, counting the files of the current epoch started."""
        return self.cursor.epoch + self.cursor.file / len(self.data.files)

    def _order(self, epoch: int) -> list[int]:
        making = self.data.making
        return epoch_order(len(self.data.files), epoch, making.seed, making.shuffle)

    def _next_file(self) -> None:
        c = self.cursor
        if c.file + 1 < len(self.data.files):
            self.cursor = Cursor(c.epoch, c.file + 1)
            return
        if not self._epoch_rows:
            raise DataError(
                f"no usable samples in the streamed training data "
                f"({', '.join(f.label for f in self.data.files[:3])}): every row was dropped "
                f"or rejected"
            )
        self.cursor, self._epoch_rows = Cursor(c.epoch + 1), 0

    def _block(self) -> pa.Table | None:
        """The rows of the cursor's block, made once; None past the file's end."""
        if self._rows is None:
            c = self.cursor
            file = self.data.files[self._order(c.epoch)[c.file]]
            raw = self._read(file, (c.epoch, c.file, c.block))
            if raw is None:
                return None
            self._rows = self._make_rows(file, c, raw)
        return self._rows

    def _read(self, file: StreamFile, where: tuple[int, int, int]) -> dict[str, list] | None:
        """Block `where[2]` of `file`'s rows (columns of lists), read on from the previous
        block where it was the one before; None past the file's end."""
        if self._reader is None or self._reader[0] != where:
            self._reader = (where, reader(file, where[2] * BLOCK_ROWS))
        batch = read_block(file, self._reader[1], where[2] * BLOCK_ROWS)
        self._reader = ((where[0], where[1], where[2] + 1), self._reader[1])
        return batch

    def _make_rows(self, file: StreamFile, cursor: Cursor, raw: dict[str, list]) -> pa.Table:
        """One block's rows: its rows encoded, checked, cut or dropped, then made into rows."""
        first = cursor.block * BLOCK_ROWS + 1
        numbers = list(range(first, first + len(next(iter(raw.values()), []))))
        units = encode_units(self.data, file, raw, numbers, self.log)
        c, seed = cursor, self.data.making.seed
        return make_block_rows(self.data.making, units, block_seed(seed, c.epoch, c.file, c.block))


def encode_units(
    data: StreamedData,
    file: StreamFile,
    raw: dict[str, list],
    numbers: list[int],
    log: Callable[[str], None],
) -> pa.Table:
    """The samples (input_ids, targets) of `raw`, rows `numbers` of `file`: encoded and
    checked as prepared data is; over-long and short ones dropped, bad ones skipped (with
    data.on_invalid skip), and the block's drops logged."""
    making = data.making
    if file.kind == "text":  # one document per line; blank lines are not documents
        keep = [k for k, text in enumerate(raw["text"]) if text.strip()]
        raw, numbers = {"text": [raw["text"][k] for k in keep]}, [numbers[k] for k in keep]
    encoded = data.encoders[file.source](raw) if numbers else {"status": []}
    kept, dropped, skipped = [], {"dropped": 0, "short": 0}, []
    for k, status in enumerate(encoded["status"]):
        where = f"{file.label} row {numbers[k]}"
        if status in KEPT:
            kept.append(k)
        elif status in dropped:
            dropped[status] += 1
        elif status == "overlength":
            raise DataError(
                f"{where}: {encoded['length'][k]} tokens, over data.cutoff_len="
                f"{making.cutoff_len} (data.overlength=error); raise data.cutoff_len, or "
                f"set data.overlength: truncate, drop or split (pt)"
            )
        elif status == "template" or making.on_invalid == "error":
            raise DataError(
                f"{where}: {encoded['reason'][k]}; fix the row, or set data.on_invalid: "
                f"skip to train without it"
            )
        else:
            skipped.append(f"row {numbers[k]}: {encoded['reason'][k]}")
    if any(dropped.values()) or skipped:
        _note(file, numbers, dropped, skipped, log)
    columns = {name: [encoded[name][k] for k in kept] for name in UNITS.names}
    return pa.table(columns, schema=UNITS)


def make_block_rows(making: RowMaking, units: pa.Table, seed: int) -> pa.Table:
    """A block's samples cut (data.overlength split), made into rows (packed with
    data.packing) and, with data.shuffle, put in an order drawn from `seed`."""
    if making.overlength == "split":
        units = cut_into_pieces(units, making.cutoff_len, making.min_len)
    rows = make_rows(units, making.packing, making.cutoff_len, seed)
    if making.shuffle and not making.packing:  # first_fit packs in a seeded order already
        rows = rows.take(np.random.default_rng(seed).permutation(rows.num_rows))
    return rows


def _note(file: StreamFile, numbers: list[int], dropped: dict, skipped: list[str], log) -> None:
    """Log a block's dropped rows ({"dropped": over cutoff_len, "short": under min_len})
    and skipped ones."""
    parts = [f"{dropped['dropped']} over data.cutoff_len dropped"] if dropped["dropped"] else []
    if dropped["short"]:
        parts.append(f"{dropped['short']} under data.min_len dropped")
    if skipped:
        parts.append(f"{len(skipped)} rejected and skipped (data.on_invalid=skip; {skipped[0]})")
    log(f"data: {file.label} rows {numbers[0]}-{numbers[-1]}: {', '.join(parts)}")


def read_block(file: StreamFile, rows: Iterator, first: int) -> dict[str, list] | None:
    """The next BLOCK_ROWS rows of `rows`, a reader of `file` standing after `first` rows
    (columns of lists); None past the file's end."""
    try:
        return next(rows, None)
    except DataError:
        raise
    except Exception as exc:  # a row the library cannot parse: name the file and block
        raise DataError(
            f"{file.label}: cannot be read as {file.kind} in rows {first + 1}-"
            f"{first + BLOCK_ROWS}: {exc}; find the row with data.streaming=false "
            f"(keel validate lists every bad row)"
        ) from None


def reader(file: StreamFile, skip: int) -> Iterator[dict[str, list]]:
    """`file`'s rows after the first `skip`, BLOCK_ROWS at a time, read lazily."""
    from datasets import load_dataset

    if not file.path.is_file():
        raise DataError(f"{file.label}: the file is gone (it was there when the run started)")
    rows = load_dataset(
        file.kind,
        data_files=str(file.path),
        split="train",
        streaming=True,
        **_READ_OPTIONS.get(file.kind, {}),
    )
    return rows.skip(skip).iter(batch_size=BLOCK_ROWS) if skip else rows.iter(BLOCK_ROWS)


def _first_row(file: StreamFile) -> dict | None:
    """The file's first non-blank row, None if it has none (what its entry's format is
    detected from)."""
    try:
        batch = next(reader(file, 0), None)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{file.label}: cannot be read as {file.kind}: {exc}") from None
    for k in range(len(next(iter(batch.values()), [])) if batch else 0):
        row = {key: values[k] for key, values in batch.items()}
        if file.kind != "text" or row["text"].strip():
            return row
    return None


def block_seed(seed: int, *words: int) -> int:
    """A seed drawn from train.seed and where a block is (its packing and row order, a
    mixed block's draws): the same on every process."""
    return int(np.random.SeedSequence([seed, *words]).generate_state(1)[0])
