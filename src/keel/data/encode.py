"""Row → tokens: format, render, tokenize, mask, apply the over-length policy.

`RowEncoder` is the function given to `Dataset.map`. It never raises for a bad row: each
output row carries a `status` (ok, truncated, dropped, overlength, rejected, template) and a
`reason`, so the pipeline can report every problem at once, with its file and row.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.data.formats import FormatSpec, RowError, row_to_example
from keel.data.template import (
    ChatTemplate,
    TemplateMismatch,
    encode_pt,
    encode_sft,
    render,
    shift_targets,
)

IGNORE_INDEX = -100
KEPT = ("ok", "truncated")


def output_features():
    from datasets import Features, List, Value

    return Features(
        {
            "input_ids": List(Value("int32")),
            "targets": List(Value("int32")),
            "status": Value("string"),
            "reason": Value("string"),
            "length": Value("int64"),
        }
    )


@dataclass(frozen=True)
class EncodeSettings:
    stage: str  # sft or pt
    spec: FormatSpec
    template: ChatTemplate | None
    cutoff_len: int
    overlength: str  # drop, truncate or error


class RowEncoder:
    """Batched `Dataset.map` function; picklable so `num_proc` > 1 works."""

    def __init__(self, tokenizer, settings: EncodeSettings):
        self.tokenizer = tokenizer
        self.settings = settings

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {
            k: [] for k in ("input_ids", "targets", "status", "reason", "length")
        }
        n = len(next(iter(batch.values()))) if batch else 0
        for i in range(n):
            status, reason, length, ids, targets = self.encode_row(
                {k: v[i] for k, v in batch.items()}
            )
            out["status"].append(status)
            out["reason"].append(reason)
            out["length"].append(length)
            out["input_ids"].append(ids)
            out["targets"].append(targets)
        return out

    def encode_row(self, row: dict) -> tuple[str, str, int, list[int], list[int]]:
        """(status, reason, full length, input_ids, targets) for one row."""
        s = self.settings
        try:
            ids, mask = self._tokens(row_to_example(row, s.spec))
        except RowError as e:
            return "rejected", str(e), 0, [], []
        except TemplateMismatch as e:
            return "template", str(e), 0, [], []
        length, status = len(ids), "ok"
        if length > s.cutoff_len:
            if s.overlength in ("drop", "error"):
                return ("dropped" if s.overlength == "drop" else "overlength"), "", length, [], []
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
            return "rejected", reason, length, [], []
        return status, "", length, ids, targets

    def _tokens(self, example: list[dict] | str) -> tuple[list[int], list[bool]]:
        s = self.settings
        if isinstance(example, str):
            return encode_pt(self.tokenizer, example)
        if s.stage == "pt":
            text = render(self.tokenizer, s.template, example)
            return encode_pt(self.tokenizer, text, special_tokens=False)
        return encode_sft(self.tokenizer, s.template, example)


def encode_dataset(ds, tokenizer, settings: EncodeSettings, num_proc: int, fingerprint: str):
    """Encode every row of `ds`; the result has one output row per input row, in order."""
    procs = min(num_proc, len(ds)) if num_proc > 1 else None
    return ds.map(
        RowEncoder(tokenizer, settings),
        batched=True,
        batch_size=64,
        remove_columns=ds.column_names,
        features=output_features(),
        keep_in_memory=True,
        num_proc=procs,
        new_fingerprint=fingerprint,  # our own cache key; skips hashing the tokenizer
        desc="keel: tokenizing",
    )
