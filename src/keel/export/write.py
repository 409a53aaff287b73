"""`keel export`'s request and its output: a plain Hugging Face folder, written all at once
(see keel.export for the sources it takes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from keel import __version__
from keel.errors import ModelError
from keel.export.hf_compat import add_legacy_keys
from keel.export.merge import build_merged_model
from keel.export.partial_folder import write_folder_atomically
from keel.export.quantize import quantize_model, quantize_scheme
from keel.export.sources import resolve_sources
from keel.models.loading import copy_processor_files, load_tokenizer
from keel.models.model_card import export_card, write_model_card
from keel.models.vocabulary import add_configured_tokens

Log = Callable[[str], None]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_MAX_SHARD_SIZE = "5GB"
MARKER_FILE = "keel_export.json"


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    """What `keel export` was asked for (see the module docstring for the sources)."""

    model: str
    adapter: str | None = None
    out: Path
    dtype: str | None = None  # bfloat16 | float16 | float32; None: the base model's
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE  # bytes, or "5GB"
    cache_dir: str | Path = "~/.cache/keel"
    # torchao-quantized decoder weights: "trained" (the scheme a QAT run trained for) or a
    # scheme name (keel.export.quantize); None: the weights as trained
    quantize: str | None = None


def export_model(request: ExportRequest, log: Log = print) -> Path:
    """Write the merged model of `request` to `request.out`; returns that folder.

    Nothing is written to `out` unless the whole export succeeds: it is built in a temporary
    folder beside `out` and renamed at the end. A non-empty `out` is refused, untouched.
    """
    target_dtype = _parse_dtype(request.dtype)
    out = check_out(Path(request.out).expanduser())
    sources = resolve_sources(request.model, request.adapter, request.cache_dir, log)
    qat = (
        None
        if request.quantize is None
        else quantize_scheme(request.quantize, sources, request.model)
    )
    tokenizer = load_tokenizer(sources.tokenizer_dir)
    if sources.checkpoint is not None and sources.checkpoint.added_tokens is not None:
        add_configured_tokens(tokenizer, sources.checkpoint.added_tokens)  # as the run did
    if not tokenizer.chat_template:
        log(f"note: the tokenizer in {sources.tokenizer_dir} has no chat template")
    model, base_dtype, merge_diff = build_merged_model(sources, tokenizer, log)
    dtype = target_dtype or base_dtype
    _cast(model, dtype)
    _stop_at_end_of_turn(model, tokenizer)
    quantized = None if qat is None else quantize_model(model, qat, log)
    provenance = {
        "base": str(sources.base_dir),
        "adapter": str(sources.adapter_dir) if sources.adapter_dir else None,
        "checkpoint": str(sources.checkpoint.path) if sources.checkpoint else None,
        "dtype": str(dtype).removeprefix("torch."),
        "merge_max_abs_logit_diff": merge_diff,
        "quantized": quantized,
        "keel_version": __version__,
    }

    def write(folder: Path) -> None:
        write_model_folder(folder, model, tokenizer, request.max_shard_size)
        (folder / MARKER_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        card = export_card(request.model, request.adapter, provenance["dtype"])
        write_model_card(folder, card, shown_as=out)

    write_folder_atomically(out, write, log)
    what = f"{qat.scheme}-quantized " if qat is not None else ""
    log(f"exported {what}{provenance['dtype']} model -> {out}")
    return out


def write_model_folder(folder: Path, model, tokenizer, max_shard_size: int | str) -> None:
    """A plain Hugging Face model folder: the model's safetensors shards and config, the
    tokenizer, a vision-language model's processor files."""
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    # The template goes into tokenizer_config.json, which every transformers version (and
    # llama.cpp's converter) reads; only newer ones read chat_template.jinja.
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)
    copy_processor_files(model, folder)  # a vision-language model's image processor
    add_legacy_keys(folder)  # so that transformers 4.x readers load it too


def _parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ModelError(
            f"--dtype {name}: not a dtype keel exports; use one of {', '.join(DTYPES)}, or "
            f"leave it out to keep the base model's"
        )
    return DTYPES[name]


def check_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise ModelError(f"--out {out} is a file; give a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ModelError(
            f"--out {out} is not empty; keel never overwrites it: give a new folder, "
            f"or delete {out} first"
        )
    return out


def _cast(model, dtype: torch.dtype) -> None:
    model.to(dtype)
    if dtype is not torch.float16:
        return
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():  # fp32 weights were finite: fp16 overflowed
            raise ModelError(
                f"{name} has values beyond float16's range (±65504); export with "
                f"--dtype bfloat16 (same range as float32) or float32"
            )


def _stop_at_end_of_turn(model, tokenizer) -> None:
    """Make generation stop at the tokenizer's end-of-turn token as well.

    Chat models end an answer with the template's end token (e.g. <|im_end|>), which base
    configs often do not list; without it `generate` runs on to max_new_tokens.
    """
    eos = tokenizer.eos_token_id
    config = model.generation_config
    if eos is None or config is None:
        return
    listed = config.eos_token_id
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    if eos not in listed:
        config.eos_token_id = [*listed, eos] if listed else eos
