"""Row → tokens: format, render, tokenize, mask, apply the over-length policy.

`RowEncoder` is the function given to `Dataset.map`. It never raises for a bad row: each
output row carries a `status` (ok, truncated, dropped, short, overlength, rejected, template)
and a
`reason`, so the pipeline can report every problem at once, with its file and row.
`RowEncoder` encodes SFT and pretraining rows; keel.data.encode_preference adds pairs and
KTO samples. With a vision-language model (`EncodeSettings.vision`) rows may hold images:
keel.data.vision turns them into image tokens and the `image_blobs` (and, for M-RoPE
families, `rope_positions`) columns; a text model's run keeps exactly the text columns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from keel.data.formats import Example, FormatSpec, RowError, without_system
from keel.data.template import (
    ChatTemplate,
    TemplateMismatch,
    encode_pt,
    encode_sft,
    render,
    shift_targets,
)
from keel.data.tools import check_tool_template, read_example
from keel.data.vision import encode_with_images, image_columns, refuse_images, vision_features
from keel.errors import DataError
from keel.stages.registry import get_stage

if TYPE_CHECKING:
    from keel.config.schema import DataConfig
    from keel.models.vision import VisionProcessing

IGNORE_INDEX = -100
# split: a pretraining document over cutoff_len, kept whole here and cut into pieces after
# the validation split (keel.data.packing.cut_into_pieces), so a document's pieces never
# straddle train and eval
KEPT = ("ok", "truncated", "split")


def output_features(extra: dict | None = None):
    """The encoded columns: tokens, targets and the row's status, plus `extra` features."""
    from datasets import Features, List, Value

    return Features(
        {
            "input_ids": List(Value("int32")),
            "targets": List(Value("int32")),
            "status": Value("string"),
            "reason": Value("string"),
            "length": Value("int64"),
            **(extra or {}),
        }
    )


@dataclass(frozen=True)
class EncodeSettings:
    stage: str  # pt, sft, dpo, orpo, simpo or kto
    spec: FormatSpec
    template: ChatTemplate | None
    cutoff_len: int
    overlength: str  # drop, truncate, error or split (pt); never auto (resolved before)
    min_len: int = 0  # pt, sft: fewer tokens and the sample is dropped ("short")
    vision: VisionProcessing | None = None  # the run's vision-language model, None for text
    media_dir: Path | None = None  # relative image paths are read from here
    train_on_prompt: bool = False  # sft: every token trains, not only the assistant turns'
    mask_history: bool = False  # sft: only the last assistant turn trains
    drop_system: bool = False  # the dataset's rows lose their system prompts first


class RowEncoder:
    """Batched `Dataset.map` function; picklable so `num_proc` > 1 works.

    Subclasses encode other kinds of rows: `encode_row` returns a dict with some of the
    `features()` columns (status at least); a column it leaves out is empty (or 0)."""

    def __init__(self, tokenizer, settings: EncodeSettings):
        self.tokenizer = tokenizer
        self.settings = settings
        self._text_ids: dict[str, list[int]] = {}  # this batch's plain texts, tokenized

    def features(self):
        return output_features(vision_features(self.settings.vision))

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        from datasets import Value

        empty = {
            k: ([] if not isinstance(f, Value) else "" if f.dtype == "string" else 0)
            for k, f in self.features().items()
        }
        out: dict[str, list] = {k: [] for k in empty}
        n = len(next(iter(batch.values()))) if batch else 0
        rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
        if self.settings.drop_system:
            rows = [without_system(row, self.settings.spec) for row in rows]
        self._text_ids = self._tokenized_texts(rows)
        try:
            for row in rows:
                encoded = self.encode_row(row)
                for k in out:
                    out[k].append(encoded.get(k, empty[k]))
        finally:
            self._text_ids = {}
        return out

    def _tokenized_texts(self, rows: list[dict]) -> dict[str, list[int]]:
        """Pretraining rows' plain texts tokenized in one call: the fast tokenizer encodes a
        batch in one pass (1.8x faster than a call a row for the bundled tokenizer), to the
        same ids. {} for every other kind of row."""
        s = self.settings
        if get_stage(s.stage).unit != "text" or s.vision is not None or s.spec.format != "text":
            return {}
        texts = []
        for row in rows:
            try:
                content = read_example(row, s.spec).content
            except RowError:  # encode_row rejects it, with the reason
                continue
            if isinstance(content, str):
                texts.append(content)
        if not texts:
            return {}
        return dict(zip(texts, self.tokenizer(texts)["input_ids"], strict=True))

    def encode_row(self, row: dict) -> dict:
        """SFT/PT: status, reason, full length, input_ids and targets of one row."""
        s = self.settings
        images = None
        try:
            example = read_example(row, s.spec)
            if s.vision is None:
                refuse_images(example)
                ids, mask = self._tokens(example)
            elif example.tools or _has_tool_turns(example):
                raise RowError("tool-calling rows are trained with text models only")
            else:
                ids, mask, images = encode_with_images(
                    self.tokenizer, s, example, last_only=s.mask_history
                )
        except RowError as e:
            return {"status": "rejected", "reason": str(e)}
        except TemplateMismatch as e:
            return {"status": "template", "reason": str(e)}
        length, status = len(ids), "ok"
        if length < s.min_len:  # judged whole, before a cut (as Axolotl filters, then cuts)
            return {"status": "short", "length": length}
        if length > s.cutoff_len and s.overlength == "split":
            status = "split"
        elif length > s.cutoff_len:
            if s.overlength in ("drop", "error"):
                status = "dropped" if s.overlength == "drop" else "overlength"
                return {"status": status, "length": length}
            if images is not None:
                try:
                    images = images.cut(s.cutoff_len)
                except RowError as e:
                    files = list(images.files)
                    return {
                        "status": "dropped",
                        "reason": str(e),
                        "length": length,
                        "image_files": files,
                    }
            ids, mask, status = ids[: s.cutoff_len], mask[: s.cutoff_len], "truncated"
        targets = shift_targets(ids, mask)
        if all(t == IGNORE_INDEX for t in targets):
            if status == "truncated":
                reason = (
                    f"all labels masked after truncation to cutoff_len {s.cutoff_len} "
                    f"({length} tokens; the answer starts after the cut)"
                )
            else:
                reason = "all labels masked: no assistant tokens to train on"
            return {"status": "rejected", "reason": reason, "length": length}
        out = {"status": status, "length": length, "input_ids": ids, "targets": targets}
        if images is not None:
            out |= image_columns(s.vision, [(ids, images)]) | {"image_files": list(images.files)}
        return out

    def _tokens(self, example: Example) -> tuple[list[int], list[bool]]:
        s, content = self.settings, example.content
        if isinstance(content, str):
            return encode_pt(self.tokenizer, content, ids=self._text_ids.get(content))
        if example.tools or _has_tool_turns(example):
            check_tool_template(s.template)  # a DataError: the run's template, not the row
        if get_stage(s.stage).unit == "text":  # a conversation pretrained on as plain text
            text = render(self.tokenizer, s.template, content, tools=example.tools)
            return encode_pt(self.tokenizer, text, special_tokens=False)
        ids, mask = encode_sft(
            self.tokenizer, s.template, content, last_only=s.mask_history, tools=example.tools
        )
        return ids, [True] * len(ids) if s.train_on_prompt else mask


def _has_tool_turns(example: Example) -> bool:
    return not isinstance(example.content, str) and any(
        m["role"] == "tool" or m.get("tool_calls") for m in example.content
    )


def encode_dataset(ds, encoder: RowEncoder, num_proc: int, fingerprint: str):
    """Encode every row of `ds` with `encoder`; one output row per input row, in order."""
    procs = min(num_proc, len(ds)) if num_proc > 1 else None
    return ds.map(
        encoder,
        batched=True,
        batch_size=64,
        remove_columns=ds.column_names,
        features=encoder.features(),
        keep_in_memory=True,
        num_proc=procs,
        new_fingerprint=fingerprint,  # our own cache key; skips hashing the tokenizer
        desc="keel: tokenizing",
    )


def resolve_overlength(cfg: DataConfig, stage: str, vision) -> DataConfig:
    """`cfg` with data.overlength auto made concrete: split for pretraining text (a long
    document is cut into pieces, not lost), drop for every other unit and for a
    vision-language model's rows, which a cut could split inside an image."""
    splits = get_stage(stage).unit == "text" and vision is None
    if cfg.overlength == "split" and vision is not None:
        raise DataError(
            "data.overlength = split cuts pretraining text into pieces of data.cutoff_len "
            "tokens, and a vision-language model's rows hold images a cut could split; use "
            "drop, truncate (never cuts inside an image) or error"
        )
    if cfg.overlength != "auto":
        return cfg
    return replace(cfg, overlength="split" if splits else "drop")
