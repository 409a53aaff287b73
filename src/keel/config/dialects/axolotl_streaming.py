"""Axolotl's streamed data: `pretraining_dataset` (always streamed) and `streaming: true` as
keel's data.streaming, which reads, checks and tokenizes the rows as training goes."""

from __future__ import annotations

from keel.config.dialects.axolotl_data import read_data_files
from keel.config.dialects.build import Build, streaming
from keel.config.dialects.report import unknown_key

_PRETRAINING_KEYS = ("path", "name", "split", "text_column", "type", "data_files")
_PACKING_WHY = "keel packs the rows of each block of 1024 rows it reads"


def pretraining_stage(raw: dict) -> str | None:
    """pt when the run reads `pretraining_dataset` (and no `datasets`, which it would ignore)."""
    return "pt" if raw.get("pretraining_dataset") and not raw.get("datasets") else None


def _pretraining_dataset(build: Build, key: str, value) -> None:
    """Each entry as a text dataset of data.datasets, streamed; documents over sequence_len
    cut into pieces, as their pretraining packs the text into sequence_len rows."""
    if build.raw.get("datasets"):
        build.refused(key, "beside datasets, which Axolotl then ignores; keep one of the two")
        return
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        build.refused(key, f"{value!r} must be a list of datasets (path:, text_column:)")
        return
    out = [_entry(build, f"{key}.{index}", entry) for index, entry in enumerate(entries)]
    build.set("data.datasets", out)
    build.put(key, "data.streaming", True, "Axolotl streams pretraining_dataset")
    build.kept("data.overlength", "split", "their pretraining cuts the text into sequence_len rows")


def _entry(build: Build, prefix: str, entry: dict) -> dict:
    index = prefix.rsplit(".", 1)[1]
    ds: dict = {"format": "text"}
    target = f"data.datasets.{index}"
    for key, value in entry.items():
        name = f"{prefix}.{key}"
        if key in ("path", "split"):
            ds[key] = value
            build.mapped(name, f"{target}.{key}")
        elif key == "name" and value is not None:
            ds["subset"] = value
            build.mapped(name, f"{target}.subset", "the Hub dataset's configuration")
        elif key == "text_column":
            ds["columns"] = {"prompt": value}
            build.mapped(name, f"{target}.columns.prompt", "the column of plain text")
        elif key == "type" and value in (None, "pretrain"):
            build.mapped(name, f"{target}.format", "plain text, every token trained")
        elif key == "data_files":
            continue  # read once the path is known
        elif key == "trust_remote_code" and not value:
            build.ignored(name, "false: keel runs no dataset script")
        elif key == "type":
            build.refused(name, f"{value!r}: keel streams plain text (type: pretrain) only")
        elif key == "skip" and value:
            build.refused(name, "keel reads every row of a streamed file; drop the first rows")
        else:
            why = "an Axolotl pretraining_dataset key keel has no counterpart for; remove it"
            build.refused(name, unknown_key(key, _PRETRAINING_KEYS, why))
    read_data_files(build, prefix, entry, ds, target)
    return ds


def _buffer(build: Build, key: str, _value) -> None:
    build.ignored(key, _PACKING_WHY)


def _multipack_attention(build: Build, key: str, value) -> None:
    if value is False:
        build.refused(
            key, "false lets packed documents attend to each other; keel's packing keeps "
            "attention within each one: remove it"
        )  # fmt: skip
    else:
        build.ignored(key, "keel's packing keeps attention within each document")


STREAMING_HANDLERS = {
    "pretraining_dataset": _pretraining_dataset,
    "streaming": streaming,
    "streaming_multipack_buffer_size": _buffer,
    "pretrain_multipack_buffer_size": _buffer,
    "pretrain_multipack_attn": _multipack_attention,
}
