"""`prepare_data`: sources → validated, tokenized, split, packed rows, cached on disk.

The order is fixed so that nothing reaches training unchecked: resolve every source and the
template (cheap), fingerprint, then either load the cache or load, encode and validate every
row, report, and only then split, pack and cache.

A vision-language run (`vision=`) encodes images too (keel.data.vision): its rows gain
`image_blobs` and, for M-RoPE families, `rope_positions`; its cache is keyed by the image
processing as well and invalidated when an image file changes (keel.data.cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from keel.config.schema import DataConfig
from keel.data.cache import (
    fingerprint,
    image_manifest,
    load_cached,
    save_cache,
    stale_image,
    vision_fingerprint,
)
from keel.data.dedupe import drop_duplicates
from keel.data.detect import spec_for_stage
from keel.data.encode import (
    IGNORE_INDEX,
    KEPT,
    EncodeSettings,
    encode_dataset,
    resolve_overlength,
)
from keel.data.encode_preference import encoder_for
from keel.data.encode_prompt import IMAGE_REFS, prompt_rows
from keel.data.formats import FormatSpec
from keel.data.kto import add_kl_sequences
from keel.data.mixing import source_loader
from keel.data.packing import cut_into_pieces, make_rows, split_indices
from keel.data.report import DataReport, FileStats, Rejection, SplitStats, list_capped
from keel.data.sources import Source, SourceUnit, resolve_sources
from keel.data.template import ChatTemplate, resolve_template
from keel.errors import DataError
from keel.stages.registry import STAGES

if TYPE_CHECKING:
    from datasets import Dataset

    from keel.models.vision import VisionProcessing


_UNIT_COLUMNS = (
    *("input_ids", "targets", "seq_lens", "labels", "prompt_len", "margin"),
    *("prompt", "columns", IMAGE_REFS),  # grpo's prompt rows (keel.data.encode_prompt)
    *("image_blobs", "rope_positions"),  # a vision-language run's
)


@dataclass(frozen=True)
class Encoding:
    """What every source of one run is encoded with."""

    cfg: DataConfig
    tokenizer: object
    template: ChatTemplate
    stage: str
    vision: VisionProcessing | None
    fingerprint: str

    def settings(self, src: Source, spec: FormatSpec) -> EncodeSettings:
        """How `src`'s rows, read as `spec`, are encoded."""
        return EncodeSettings(
            stage=self.stage,
            spec=spec,
            template=self.template if spec.format != "text" else None,
            cutoff_len=self.cfg.cutoff_len,
            overlength=self.cfg.overlength,
            min_len=self.cfg.min_len,
            vision=self.vision,
            media_dir=src.media_dir,
            train_on_prompt=self.cfg.train_on_prompt,
            mask_history=self.cfg.mask_history,
            drop_system=src.config.drop_system,
        )


@dataclass
class PreparedData:
    """Rows ready for `collate`: input_ids, targets (pre-shifted), position_ids, num_targets;
    for the preference stages also labels (one per sequence) and, for kto, the KL sequences
    (kl_input_ids, kl_targets, kl_position_ids). See `prepare_data`."""

    train: Dataset | None  # None: the evaluation data alone (prepare_data's held_out_only)
    eval: Dataset | None  # None without evaluation data (data.val_size 0, no eval_datasets)
    report: DataReport
    fingerprint: str
    from_cache: bool = False  # True when loaded from <cache_dir>/data/<fingerprint>

    @property
    def num_rows(self) -> int | None:
        """Training rows (keel.data.stream.StreamedData's is None: not known ahead)."""
        return len(self.train)

    def longest_prompt(self) -> int | None:
        """Tokens of the longest training prompt when the rows are prompts (grpo: each is
        answered online, so the planner counts it and a completion), else None."""
        if "prompt" not in self.train.column_names or not len(self.train):
            return None
        lengths = pc.list_value_length(self.train.with_format("arrow")["input_ids"])
        return int(pc.max(lengths).as_py())


def prepare_data(
    cfg: DataConfig,
    tokenizer,
    *,
    stage: str,
    cache_dir: Path,
    base_dir: Path,
    seed: int,
    log: Callable[[str], None] = print,
    vision: VisionProcessing | None = None,
    held_out_only: bool = False,
) -> PreparedData:
    """Load, validate, tokenize, split and pack the data of `cfg`, or load it from the cache.

    stage: a stage of keel.stages.registry; its data unit decides what a row is: text (pt,
    every token is a target), a conversation (sft, targets on assistant tokens only), a pair
    (dpo, orpo, simpo), a labelled sample (kto) or a prompt alone (grpo).
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
    With `vision` (keel.models.vision.vision_processing; None: a text model, which rejects
    rows with images) rows also have image_blobs (per image, in token order) and, for
    M-RoPE families, rope_positions (3 per token).
    Prompt rows (grpo) are different: input_ids, num_targets 0, and the JSON strings prompt
    and columns, one prompt per row, never packed (keel.data.encode_prompt).
    `held_out_only`: data.eval_datasets alone (train None), beside training data that is
    streamed (keel.data.stream)."""
    _check_tokenizer(tokenizer, stage, vision)
    cfg = resolve_overlength(cfg, stage, vision)
    base_dir, cache_dir = Path(base_dir), Path(cache_dir)
    sources = (
        [] if held_out_only else _sources(cfg, base_dir, stage, text_only=vision is None, log=log)
    )
    held_out = _sources(cfg, base_dir, stage, text_only=vision is None, log=log, held_out=True)
    template, note = resolve_template(cfg.template, tokenizer, base_dir)
    fp = fingerprint(cfg, sources + held_out, template, tokenizer, stage, seed)
    fp = vision_fingerprint(fp, vision) if vision is not None else fp
    target = cache_dir / "data" / fp
    if (cached := _load_cache(target, log)) is not None:
        log(f"data: loaded from cache {target}")
        log(cached[2].format())
        return PreparedData(*cached, fp, from_cache=True)

    # before the work: a large dataset takes a while, and the tokenizer's bar is hidden
    # unless --verbose
    read = sources or held_out
    shown = ", ".join(source.label for source in read[:3]) + (", ..." if len(read) > 3 else "")
    log(f"data: reading, checking and tokenizing {shown} (once: the result is cached)")
    report = empty_report(cfg, stage)
    load = source_loader(cfg, cache_dir=cache_dir, base_dir=base_dir, seed=seed, log=log)
    encoding = Encoding(cfg, tokenizer, template, stage, vision, fp)
    encoded = _encode_sources(encoding, sources, load(sources), report)
    samples, overlong, used_template, images = encoded
    units = _Units(samples)
    if held_out:  # encoded after the training data: LLaMA-Factory's num_samples draws in order
        eval_samples, eval_overlong, eval_template, eval_images = _encode_sources(
            encoding, held_out, load(held_out), report
        )
        units = _Units(samples, eval_samples)
        overlong, used_template = overlong + eval_overlong, used_template or eval_template
        images |= eval_images
    if used_template:
        report.template = template.name
        if note:
            log(note)
    _check(cfg, report, overlong, train=not held_out_only)
    if cfg.deduplicate:
        units = _deduplicated(units, report)
    train, eval_ = _rows(cfg, units, stage=stage, seed=seed, report=report, log=log)
    save_cache(target, train, eval_, report, image_manifest(images))
    train, eval_, report = load_cached(target)  # serve the cached copy: identical on reruns
    log(f"data: prepared and cached at {target}")
    log(report.format())
    return PreparedData(train, eval_, report, fp, from_cache=False)


def _sources(
    cfg: DataConfig, base_dir: Path, stage: str, *, text_only: bool, log, held_out: bool = False
) -> list:
    """The run's data sources (held_out: its evaluation data's, data.eval_datasets), their
    notes logged; image entries refused for a text model."""
    sources = resolve_sources(cfg, base_dir, stage=stage, held_out=held_out)
    if text_only:
        _refuse_image_entries(sources)
    for note in (n for src in sources for n in src.notes):
        log(f"note: {note}")
    return sources


@dataclass(frozen=True)
class _Units:
    """The encoded units (samples, pairs, prompts) of the training data, and of the
    evaluation data when it has its own (data.eval_datasets; else None: val_size splits)."""

    train: pa.Table
    eval: pa.Table | None = None


def _deduplicated(units: _Units, report: DataReport) -> _Units:
    """Each split without its repeated samples, counted in the report; a training sample
    may also be an evaluation one (as Axolotl deduplicates test_datasets)."""
    train, report.duplicates = drop_duplicates(units.train)
    if units.eval is None:
        return _Units(train)
    held_out, copies = drop_duplicates(units.eval)
    report.duplicates += copies
    return _Units(train, held_out)


def _rows(
    cfg: DataConfig,
    units: _Units,
    *,
    stage: str,
    seed: int,
    report: DataReport,
    log: Callable[[str], None],
) -> tuple[Dataset, Dataset | None]:
    """The encoded units as train and eval rows of the stage's unit, packed up to its
    capacity (cutoff_len per sequence of a row); prompts (grpo) one per row, never packed:
    each is answered online, and its completions make the rows trained on."""
    if STAGES[stage].unit == "prompt":
        return _split_and_pack(cfg, units, seed, report, lambda table, _seed: prompt_rows(table))
    if STAGES[stage].unit == "sample":  # labelled: KTO's mismatched sequences for its KL estimate
        kl = partial(add_kl_sequences, cutoff_len=cfg.cutoff_len)  # within each split
        units = _Units(kl(units.train), None if units.eval is None else kl(units.eval))
        _note_one_sided(units.train, log)
    capacity = cfg.cutoff_len * STAGES[stage].sequences_per_row
    return _split_and_pack(
        cfg, units, seed, report, lambda table, s: make_rows(table, cfg.packing, capacity, s)
    )


def empty_report(cfg: DataConfig, stage: str) -> DataReport:
    """The report `_encode_sources` fills: the settings it was prepared with, no rows yet."""
    return DataReport(
        stage=stage,
        template="none",
        cutoff_len=cfg.cutoff_len,
        overlength=cfg.overlength,
        min_len=cfg.min_len,
        on_invalid=cfg.on_invalid,
        packing=cfg.packing,
        train_on_prompt=cfg.train_on_prompt,
        mask_history=cfg.mask_history,
    )


def _check_tokenizer(tokenizer, stage: str, vision) -> None:
    if stage not in STAGES:
        raise DataError(f"stage '{stage}': train.stage must be one of {', '.join(STAGES)}")
    # only plain text trains on every token (and prompts on none); image tokens are found
    # by character offsets
    masked = STAGES[stage].unit not in ("text", "prompt") or vision is not None
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
    import shutil

    try:
        cached = load_cached(target)
    except Exception as e:  # a damaged cache is rebuilt, never trusted
        log(f"data: ignoring unreadable cache {target} ({e}); preparing again")
        shutil.rmtree(target, ignore_errors=True)
        return None
    stale = stale_image(target) if cached is not None else None
    if stale is not None:
        log(f"data: the cache {target} is stale ({stale}); preparing again")
        shutil.rmtree(target, ignore_errors=True)
        return None
    return cached


def _refuse_image_entries(sources: list[Source]) -> None:
    """A text model's run: a dataset_info.json entry that declares images is refused whole."""
    for src in sources:
        col = src.columns.get("images") if src.entry is not None else None
        if col:
            raise DataError(
                f"{src.where} is multimodal (columns.images: "
                f"'{col}'), but model.path is a text model; images need a vision-language "
                f"model (e.g. Qwen2-VL, LLaVA), or use an entry without images"
            )


def _encode_sources(run: Encoding, sources, loaded, report):
    """Encode every unit of every source; fill `report`. Returns (samples, overlong, used
    template, image files read). `loaded`: each source's units (keel.data.mixing)."""
    tables, overlong, used_template, images = [], [], False, set()
    for i, (src, units) in enumerate(zip(sources, loaded, strict=True)):
        spec = _spec_for(src, units, run.stage, src.where)
        split = "eval" if src.held_out else "train"
        used_template |= spec.format != "text"
        encoder = encoder_for(run.tokenizer, run.settings(src, spec))
        for j, unit in enumerate(units):
            stats = FileStats(unit.file, read=unit.read, rejected=len(unit.rejections), split=split)
            report.rejections += unit.rejections
            if unit.dataset is not None and len(unit.dataset):
                fp = f"keel-{run.fingerprint[:40]}-{'eval-' if split == 'eval' else ''}{i}-{j}"
                encoded = encode_dataset(unit.dataset, encoder, run.cfg.num_proc, fp)
                table = encoded.with_format("arrow")[:]
                if "image_files" in table.column_names:
                    images.update(pc.list_flatten(table.column("image_files")).to_pylist())
                tables.append(_tally(table, unit, stats, report, overlong, run.template))
            report.files.append(stats)
    samples = pa.concat_tables(tables) if tables else None
    return samples, overlong, used_template, images


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
            stats.cut += st == "split"
            continue
        row, line = unit.row_of(k)
        where = Rejection(unit.file, row, "", line).where()
        if st == "short":  # under data.min_len
            stats.short += 1
        elif st == "dropped":
            stats.dropped += 1
            if reasons[k]:  # a vision run's row cut inside an image
                report.drops.append(Rejection(unit.file, row, reasons[k], line))
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


def _check(cfg: DataConfig, report: DataReport, overlong: list[str], *, train: bool) -> None:
    if report.rejections and cfg.on_invalid == "error":
        raise DataError(
            f"{len(report.rejections)} invalid row(s) in the training data\n{report.format()}"
        )
    if overlong:
        lines = "\n".join(list_capped(overlong))
        pieces = " or split (cut them into pieces)" if STAGES[report.stage].unit == "text" else ""
        raise DataError(
            f"{len(overlong)} row(s) longer than data.cutoff_len={cfg.cutoff_len} tokens "
            f"(data.overlength=error):\n{lines}\nraise data.cutoff_len, or set "
            f"data.overlength: truncate (cut them), drop (skip them){pieces}"
        )
    if train and report.totals("train").kept == 0:
        raise DataError(f"no usable samples in the training data\n{report.format()}")
    if cfg.eval_datasets and report.totals("eval").kept == 0:
        raise DataError(f"no usable samples in data.eval_datasets\n{report.format()}")


def _split_and_pack(
    cfg: DataConfig,
    units: _Units,
    seed: int,
    report: DataReport,
    rows_of: Callable[[pa.Table, int], pa.Table],
):
    """Split the units (samples, pairs, prompts) by data.val_size, unless the evaluation
    data has its own, and make each split's rows with `rows_of(units, seed)` (e.g. packed
    into rows of cutoff_len tokens)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    if units.eval is None:
        train_idx, eval_idx = split_indices(units.train.num_rows, cfg.val_size, seed)
        train_units, eval_units = units.train.take(train_idx), units.train.take(eval_idx)
    else:  # the training units are None beside streamed training data
        train_units, eval_units = units.train, units.eval
    made = {}
    for split, table, split_seed in (("train", train_units, seed), ("eval", eval_units, seed + 1)):
        if table is None or (split == "eval" and not table.num_rows):
            made[split] = None
            continue
        samples = table.num_rows
        if cfg.overlength == "split":  # after the split: a document's pieces stay in its split
            table = cut_into_pieces(table, cfg.cutoff_len, cfg.min_len)
        rows = rows_of(table, split_seed)
        setattr(report, split, _split_stats(samples, table.num_rows, rows))
        made[split] = Dataset(InMemoryTable(rows))
    return made["train"], made["eval"]


def _split_stats(samples: int, pieces: int, rows: pa.Table) -> SplitStats:
    """A split's counts; `pieces`: its samples after data.overlength=split cut them (shown
    only where that made more of them)."""
    tokens = pc.sum(pc.list_value_length(rows.column("input_ids"))).as_py() or 0
    targets = 0  # prompt rows (grpo) have none: their completions are generated
    if "targets" in rows.column_names:
        trained = pc.not_equal(pc.list_flatten(rows.column("targets")), IGNORE_INDEX)
        targets = pc.sum(pc.cast(trained, pa.int64())).as_py() or 0
    desirable = 0
    if "kl_input_ids" in rows.column_names:
        desirable = pc.sum(pc.list_flatten(rows.column("labels"))).as_py() or 0
    return SplitStats(
        samples=samples,
        pieces=pieces if pieces != samples else 0,
        rows=rows.num_rows,
        tokens=tokens,
        targets=targets,
        desirable=desirable,
    )


def _note_one_sided(samples: pa.Table, log: Callable[[str], None]) -> None:
    labels = pc.list_flatten(samples.column("labels")).to_numpy()
    if labels.min() == labels.max():
        kind = "desirable" if labels[0] else "undesirable"
        log(
            f"note: every KTO sample is {kind}; KTO learns from both kinds, and its "
            f"desirable_weight/undesirable_weight balance them"
        )
