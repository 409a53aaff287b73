"""The validation report: what was read from each file, what was kept, and why rows were not.

The report is built before training starts and logged once; with `data.on_invalid: error`
its text is the message of the `DataError`. It is stored as JSON beside the cached data so
a cached run reports exactly what the first run found.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from keel.stages.registry import get_stage

MAX_LISTED = 50  # rejections (or over-length rows) listed in a message before "and N more"


@dataclass
class Rejection:
    """One row that cannot be used. `row` is 1-based within its file; `line` is set for JSON."""

    file: str
    row: int | None
    reason: str
    line: int | None = None

    def where(self) -> str:
        parts = [self.file]
        if self.row is not None:
            parts.append(f"row {self.row}")
        if self.line is not None:
            parts.append(f"(line {self.line})" if self.row is not None else f"line {self.line}")
        return " ".join(parts)

    def __str__(self) -> str:
        return f"{self.where()}: {self.reason}"


@dataclass
class FileStats:
    """Counts for one source file (or one saved `datasets` directory)."""

    file: str
    read: int = 0  # rows read (malformed JSON lines included)
    kept: int = 0  # rows that became samples or pairs (truncated ones included)
    truncated: int = 0
    cut: int = 0  # over cutoff_len, cut into pieces with data.overlength=split (pt)
    dropped: int = 0  # over cutoff_len with data.overlength=drop
    short: int = 0  # under data.min_len, dropped
    rejected: int = 0
    split: str = "train"  # eval: a file of data.eval_datasets


@dataclass
class SplitStats:
    """What one split (train or eval) holds after packing."""

    samples: int = 0  # samples; pairs in dpo/orpo/simpo; prompts in grpo
    # data.overlength=split (pt): the samples' pieces of at most cutoff_len tokens; 0: none cut
    pieces: int = 0
    rows: int = 0
    tokens: int = 0
    targets: int = 0  # trained tokens
    desirable: int = 0  # kto: samples labelled desirable


@dataclass
class DataReport:
    """Everything data preparation found, per file and in total."""

    stage: str
    template: str  # "tokenizer", "chatml", a .jinja path, or "none" (plain text only)
    cutoff_len: int
    overlength: str
    on_invalid: str
    packing: bool
    min_len: int = 0  # data.min_len: shorter samples dropped (0: none)
    train_on_prompt: bool = False  # sft: the prompt's tokens train as well
    mask_history: bool = False  # sft: only the last assistant turn trains
    duplicates: int = 0  # samples dropped as copies of earlier ones (data.deduplicate)
    files: list[FileStats] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    drops: list[Rejection] = field(default_factory=list)  # dropped rows that have a reason
    train: SplitStats = field(default_factory=SplitStats)
    eval: SplitStats | None = None

    @property
    def num_rejected(self) -> int:
        return sum(f.rejected for f in self.files)

    def totals(self, split: str | None = None) -> FileStats:
        """The files' counts added up; `split` (train, eval): that split's files only."""
        total = FileStats(file="total")
        for f in self.files:
            if split is not None and f.split != split:
                continue
            total.read += f.read
            total.kept += f.kept
            total.truncated += f.truncated
            total.cut += f.cut
            total.dropped += f.dropped
            total.short += f.short
            total.rejected += f.rejected
        return total

    def settings(self) -> str:
        """The line of the settings the data is prepared with."""
        return (
            f"data: stage {self.stage}, template {self.template}, cutoff_len {self.cutoff_len}, "
            + (f"min_len {self.min_len}, " if self.min_len else "")
            + f"overlength {self.overlength}, on_invalid {self.on_invalid}, "
            f"packing {'on' if self.packing else 'off'}"
            + (
                ", train_on_prompt on (the prompt's tokens train too)"
                if self.train_on_prompt
                else ""
            )
            + (", mask_history on (only the last answer trains)" if self.mask_history else "")
        )

    def format(self, max_listed: int = MAX_LISTED) -> str:
        """A readable table: per-file counts, split sizes, then the rejected rows."""
        lines = [self.settings()]
        lines += _file_table(
            [*self.files, self.totals()], cuts=self.overlength == "split", short=self.min_len > 0
        )
        stage_unit = get_stage(self.stage).unit
        unit = {"pair": "pairs", "prompt": "prompts"}.get(stage_unit, "samples")
        for name, split in (("train", self.train), ("eval", self.eval)):
            if split is not None and split.samples:
                kto = ""
                if stage_unit == "sample":  # labelled samples
                    kto = f" ({split.desirable:,} desirable, "
                    kto += f"{split.samples - split.desirable:,} undesirable)"
                # a prompt's trained tokens are its completions, generated each step
                trained = "" if stage_unit == "prompt" else f", {split.targets:,} trained tokens"
                cut = f" (cut into {split.pieces:,} pieces)" if split.pieces else ""
                lines.append(
                    f"  {name}: {split.samples:,} {unit}{kto}{cut} in {split.rows:,} rows, "
                    f"{split.tokens:,} tokens{trained}"
                )
        if self.duplicates:
            lines.append(
                f"  {self.duplicates:,} duplicate {unit} dropped (data.deduplicate: each a copy of "
                f"an earlier one)"
            )
        if self.drops:
            lines.append("  dropped rows:")
            lines += list_capped([str(r) for r in self.drops], max_listed)
        if self.rejections:
            if self.on_invalid == "skip":
                head = "rejected rows (skipped, data.on_invalid=skip):"
            else:
                head = (
                    "rejected rows (data.on_invalid=error): fix these rows, "
                    "or set data.on_invalid: skip to train without them:"
                )
            lines.append(f"  {head}")
            lines += list_capped([str(r) for r in self.rejections], max_listed)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DataReport:
        d = dict(d)
        d["files"] = [FileStats(**f) for f in d.get("files", [])]
        d["rejections"] = [Rejection(**r) for r in d.get("rejections", [])]
        d["drops"] = [Rejection(**r) for r in d.get("drops", [])]
        d["train"] = SplitStats(**d.get("train", {}))
        d["eval"] = SplitStats(**d["eval"]) if d.get("eval") else None
        return cls(**d)


def list_capped(items: list[str], max_listed: int = MAX_LISTED, indent: str = "    ") -> list[str]:
    """Indented lines for at most `max_listed` items, then "and N more"."""
    out = [f"{indent}{item}" for item in items[:max_listed]]
    if len(items) > max_listed:
        out.append(f"{indent}and {len(items) - max_listed} more")
    return out


def _file_table(rows: list[FileStats], cuts: bool, short: bool = False) -> list[str]:
    """Per-file counts; `cuts` (data.overlength=split): the long samples cut into pieces
    where the others show those truncated (a run does one or the other); `short`
    (data.min_len): a column of the samples dropped as too short."""
    heads = ("file", "read", "kept", "split" if cuts else "truncated", "dropped")
    heads += ("short", "rejected") if short else ("rejected",)
    cells: list[tuple[str, ...]] = [heads]
    for r in rows:
        counts = [r.read, r.kept, r.cut if cuts else r.truncated, r.dropped]
        counts += [r.short, r.rejected] if short else [r.rejected]
        cells.append((f"{r.file} (eval)" if r.split == "eval" else r.file, *map(str, counts)))
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    out = []
    for c in cells:
        first = c[0].ljust(widths[0])
        rest = "  ".join(v.rjust(w) for v, w in zip(c[1:], widths[1:]))
        out.append(f"  {first}  {rest}")
    return out
