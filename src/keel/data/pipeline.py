"""`prepare_data`: sources → validated, tokenized, split, packed rows, cached on disk.

The order is fixed so that nothing reaches training unchecked: resolve every source and the
template (cheap), fingerprint, then either load the cache or load, encode and validate every
row, report, and only then split, pack and cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.config.schema import DataConfig
from keel.data.cache import fingerprint, load_cached, save_cache
from keel.data.detect import spec_for_stage
from keel.data.encode import IGNORE_INDEX, KEPT, EncodeSettings, encode_dataset
from keel.data.encode_preference import encoder_for
from keel.data.formats import FormatSpec
from keel.data.kto import add_kl_sequences
from keel.data.packing import make_rows, split_indices
from keel.data.report import DataReport, FileStats, Rejection, SplitStats, list_capped
from keel.data.sources import Source, SourceUnit, load_source, resolve_sources
from keel.data.template import ChatTemplate, resolve_template
from keel.errors import DataError
from keel.stages.registry import STAGES

if TYPE_CHECKING:
    from datasets import Dataset


_UNIT_COLUMNS = ("input_ids", "targets", "seq_lens", "labels", "prompt_len")


@dataclass
class PreparedData:
    """Rows ready for `collate`: input_ids, targets (pre-shifted), position_ids, num_targets;
    for the preference stages also labels (one per sequence) and, for kto, the KL sequences
    (kl_input_ids, kl_targets, kl_position_ids). See `prepare_data`."""

    train: Dataset
    eval: Dataset | None  # None when data.val_size == 0
    report: DataReport
    fingerprint: str
    from_cache: bool = False  # True when loaded from <cache_dir>/data/<fingerprint>


def prepare_data(
    cfg: DataConfig,
    tokenizer,
    *,
    stage: str,
    cache_dir: Path,
    base_dir: Path,
    seed: int,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Load, validate, tokenize, split and pack the data of `cfg`, or load it from the cache.

    stage: a stage of keel.stages.registry; its data unit decides what a row is: text (pt,
    every token is a target), a conversation (sft, targets on assistant tokens only), a pair
    (dpo, orpo, simpo) or a labelled sample (kto).
    Relative paths in `cfg` are resolved against `base_dir`. Every problem with the data is a
    `DataError` whose message names the file and row; the report is logged once.

    Every prepared row has input_ids, targets (targets[i]: the token position i predicts, or
    -100; each sequence's last is -100) and position_ids (0 at each sequence's first token),
    all int32 lists, and num_targets (int64): its trained tokens (pt, sft), or the pairs
    (dpo, orpo, simpo) or samples (kto) it holds. Preference rows also have labels, one per
    sequence: a pair is chosen (1) then rejected (0), prompt and answer each; a KTO sample
    is 1 (desirable) or 0. Only the answer is trained. KTO rows also have kl_input_ids,
    kl_targets and kl_position_ids: per sample, in the same order, its prompt followed by
    the next sample's answer (keel.data.kto). data.cutoff_len bounds each sequence; packed
    rows hold whole pairs up to 2 x cutoff_len tokens, KTO samples up to cutoff_len.
    """
    _check_tokenizer(tokenizer, stage)
    base_dir, cache_dir = Path(base_dir), Path(cache_dir)
    sources = resolve_sources(cfg, base_dir, stage=stage)
    for note in (n for src in sources for n in src.notes):
        log(f"note: {note}")
    template, note = resolve_template(cfg.template, tokenizer, base_dir)
    fp = fingerprint(cfg, sources, template, tokenizer, stage, seed)
    target = cache_dir / "data" / fp
    cached = _load_cache(target, log)
    if cached is not None:
        train, eval_, report = cached
        log(f"data: loaded from cache {target}")
        log(report.format())
        return PreparedData(train, eval_, report, fp, from_cache=True)

    report = _empty_report(cfg, stage)
    load = _source_loader(cfg, cache_dir=cache_dir, base_dir=base_dir, seed=seed, log=log)
    samples, overlong, used_template = _encode_sources(
        cfg, sources, tokenizer, template, stage, load, report, fp
    )
    if used_template:
        report.template = template.name
        if note:
            log(note)
    _check(cfg, report, overlong)
    train, eval_ = _rows(cfg, samples, stage=stage, seed=seed, report=report, log=log)
    save_cache(target, train, eval_, report)
    train, eval_, report = load_cached(target)  # serve the cached copy: identical on reruns
    log(f"data: prepared and cached at {target}")
    log(report.format())
    return PreparedData(train, eval_, report, fp, from_cache=False)


def _rows(
    cfg: DataConfig,
    samples: pa.Table,
    *,
    stage: str,
    seed: int,
    report: DataReport,
    log: Callable[[str], None],
) -> tuple[Dataset, Dataset | None]:
    """The encoded samples as train and eval rows of the stage's unit, packed up to its
    capacity (cutoff_len per sequence of a row)."""
    if STAGES[stage].unit == "sample":  # labelled: KTO's mismatched sequences for its KL estimate
        samples = add_kl_sequences(samples, cfg.cutoff_len)
        _note_one_sided(samples, log)
    capacity = cfg.cutoff_len * STAGES[stage].sequences_per_row
    return _split_and_pack(cfg, samples, seed, report, capacity)


def _empty_report(cfg: DataConfig, stage: str) -> DataReport:
    """The report `_encode_sources` fills: the settings it was prepared with, no rows yet."""
    return DataReport(
        stage=stage,
        template="none",
        cutoff_len=cfg.cutoff_len,
        overlength=cfg.overlength,
        on_invalid=cfg.on_invalid,
        packing=cfg.packing,
    )


def _source_loader(
    cfg: DataConfig, *, cache_dir: Path, base_dir: Path, seed: int, log: Callable[[str], None]
) -> Callable:
    """`load_source` bound to this run: one generator for every source, in order, since
    LLaMA-Factory's num_samples draws from numpy's global generator, seeded with the run's
    seed, dataset after dataset."""
    return partial(
        load_source,
        cache_dir=cache_dir,
        base_dir=base_dir,
        rng=np.random.RandomState(seed),
        log=log,
        max_row_bytes=cfg.max_row_bytes,
    )


def _check_tokenizer(tokenizer, stage: str) -> None:
    if stage not in STAGES:
        raise DataError(f"stage '{stage}': train.stage must be one of {', '.join(STAGES)}")
    masked = STAGES[stage].unit != "text"  # only plain text trains on every token
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the tokenizer has no eos token; set eos_token in its tokenizer_config.json"
        )
    if masked and not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{stage.upper()} masking needs a fast tokenizer (a tokenizer.json) for "
            f"character offsets; convert the tokenizer or use a model directory that ships "
            f"tokenizer.json"
        )


def _load_cache(target: Path, log: Callable[[str], None]):
    if not target.exists():
        return None
    try:
        return load_cached(target)
    except Exception as e:  # a damaged cache is rebuilt, never trusted
        log(f"data: ignoring unreadable cache {target} ({e}); preparing again")
        import shutil

        shutil.rmtree(target, ignore_errors=True)
        return None


def _encode_sources(cfg, sources, tokenizer, template, stage, load, report, fp):
    """Encode every unit of every source; fill `report`. Returns (samples, overlong, used).

    load: Source -> list[SourceUnit] (`load_source` with the paths and generator bound)."""
    tables, overlong, used_template = [], [], False
    for i, src in enumerate(sources):
        units = load(src)
        spec = _spec_for(src, units, stage, f"data.datasets[{i}] ({src.config.path})")
        used_template |= spec.format != "text"
        encoder = encoder_for(
            tokenizer,
            EncodeSettings(
                stage=stage,
                spec=spec,
                template=template if spec.format != "text" else None,
                cutoff_len=cfg.cutoff_len,
                overlength=cfg.overlength,
            ),
        )
        for j, unit in enumerate(units):
            stats = FileStats(unit.file, read=unit.read, rejected=len(unit.rejections))
            report.rejections += unit.rejections
            if unit.dataset is not None and len(unit.dataset):
                encoded = encode_dataset(
                    unit.dataset, encoder, cfg.num_proc, f"keel-{fp[:40]}-{i}-{j}"
                )
                table = encoded.with_format("arrow")[:]
                tables.append(_tally(table, unit, stats, report, overlong, template))
            report.files.append(stats)
    samples = pa.concat_tables(tables) if tables else None
    return samples, overlong, used_template


def _spec_for(src: Source, units: list[SourceUnit], stage: str, where: str) -> FormatSpec:
    first = next((u.dataset[0] for u in units if u.dataset is not None and len(u.dataset)), None)
    if first is not None:
        where = f"{where}, file {next(u.file for u in units if u.dataset is not None)}"
    return spec_for_stage(first, src.format, src.columns, src.tags, stage, where)


def _tally(
    table: pa.Table,
    unit: SourceUnit,
    stats: FileStats,
    report: DataReport,
    overlong: list[str],
    template: ChatTemplate,
) -> pa.Table:
    """Count statuses into `stats`/`report`; return the kept units (input_ids, targets and,
    for the preference stages, seq_lens, labels, prompt_len)."""
    status = table.column("status").to_pylist()
    reasons = table.column("reason").to_pylist()
    lengths = table.column("length").to_pylist()
    keep = []
    for k, st in enumerate(status):
        if st in KEPT:
            keep.append(k)
            stats.kept += 1
            stats.truncated += st == "truncated"
            continue
        row, line = unit.row_of(k)
        where = Rejection(unit.file, row, "", line).where()
        if st == "dropped":
            stats.dropped += 1
        elif st == "overlength":
            overlong.append(f"{where}: {lengths[k]} tokens")
        elif st == "template":
            raise DataError(
                f"{where}: data.template ({template.name}): {reasons[k]}, so the assistant "
                f"tokens cannot be located for masking; set data.template to chatml or to a "
                f".jinja template that renders earlier turns unchanged"
            )
        else:
            stats.rejected += 1
            report.rejections.append(Rejection(unit.file, row, reasons[k], line))
    columns = [c for c in _UNIT_COLUMNS if c in table.column_names]
    return table.select(columns).take(pa.array(keep, type=pa.int64()))


def _check(cfg: DataConfig, report: DataReport, overlong: list[str]) -> None:
    if report.rejections and cfg.on_invalid == "error":
        raise DataError(
            f"{len(report.rejections)} invalid row(s) in the training data\n{report.format()}"
        )
    if overlong:
        lines = "\n".join(list_capped(overlong))
        raise DataError(
            f"{len(overlong)} row(s) longer than data.cutoff_len={cfg.cutoff_len} tokens "
            f"(data.overlength=error):\n{lines}\nraise data.cutoff_len, or set "
            f"data.overlength: truncate (cut them) or drop (skip them)"
        )
    if report.totals().kept == 0:
        raise DataError(f"no usable samples in the training data\n{report.format()}")


def _split_and_pack(
    cfg: DataConfig, samples: pa.Table, seed: int, report: DataReport, capacity: int
):
    """Split the units (samples, pairs) and pack each split into rows of `capacity` tokens."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    train_idx, eval_idx = split_indices(samples.num_rows, cfg.val_size, seed)
    train = make_rows(samples.take(train_idx), cfg.packing, capacity, seed)
    report.train = _split_stats(len(train_idx), train)
    eval_ = None
    if len(eval_idx):
        eval_ = make_rows(samples.take(eval_idx), cfg.packing, capacity, seed + 1)
        report.eval = _split_stats(len(eval_idx), eval_)
        eval_ = Dataset(InMemoryTable(eval_))
    return Dataset(InMemoryTable(train)), eval_


def _split_stats(samples: int, rows: pa.Table) -> SplitStats:
    tokens = pc.sum(pc.list_value_length(rows.column("input_ids"))).as_py() or 0
    trained = pc.not_equal(pc.list_flatten(rows.column("targets")), IGNORE_INDEX)
    targets = pc.sum(pc.cast(trained, pa.int64())).as_py() or 0
    desirable = 0
    if "kl_input_ids" in rows.column_names:
        desirable = pc.sum(pc.list_flatten(rows.column("labels"))).as_py() or 0
    return SplitStats(
        samples=samples, rows=rows.num_rows, tokens=tokens, targets=targets, desirable=desirable
    )


def _note_one_sided(samples: pa.Table, log: Callable[[str], None]) -> None:
    labels = pc.list_flatten(samples.column("labels")).to_numpy()
    if labels.min() == labels.max():
        kind = "desirable" if labels[0] else "undesirable"
        log(
            f"note: every KTO sample is {kind}; KTO learns from both kinds, and its "
            f"desirable_weight/undesirable_weight balance them"
        )
