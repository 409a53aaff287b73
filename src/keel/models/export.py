"""`keel export`: a base model plus an adapter or a training checkpoint, merged into one plain
Hugging Face model folder.

The folder is what `AutoModelForCausalLM.from_pretrained` and vLLM load as they are:
safetensors shards (with an index when there are several), config.json,
generation_config.json, the tokenizer and its chat template. No adapter files, and nothing
keel-specific is needed to read it.

Where the weights come from (the sources `keel chat` takes, plus training checkpoints):
  --model    HF model dir | bundled:NAME | keel output dir (its final adapter or model)
             | <output.dir>/checkpoints/step-N (on the model the run trained)
  --adapter  PEFT adapter dir | keel output dir of a LoRA run | checkpoints/step-N
A checkpoint holds the trainable weights only (a LoRA adapter, or the trained layers of a
full or freeze run), sharded by torch.distributed.checkpoint across however many processes
trained. They are loaded into the base rebuilt with the run's method, then merged.

Merging is done in fp32 whatever the base's dtype, so W + scale * B @ A is rounded once,
when the result is cast to the output dtype; this needs 4 bytes of memory per parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from keel import __version__
from keel.config.schema import BUNDLED_PREFIX
from keel.errors import ModelError
from keel.models.adapters import adapter_base
from keel.models.bundled import resolve_model_path
from keel.models.checkpoint_source import (
    TrainingCheckpoint,
    is_checkpoint,
    load_checkpoint_weights,
    read_checkpoint,
    refuse_unfinished_run,
)
from keel.models.hf_compat import add_legacy_keys
from keel.models.loading import load_model, load_tokenizer
from keel.models.model_card import export_card, write_model_card
from keel.models.partial_folder import write_folder_atomically
from keel.models.safetensors_files import read_checked

Log = Callable[[str], None]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_MAX_SHARD_SIZE = "5GB"
MARKER_FILE = "keel_export.json"
# Largest |merged - unmerged| logit accepted, relative to the largest |logit| (at least 1).
# Both run in fp32, so correct merges differ by round-off (~1e-6); a merge that went wrong
# (e.g. into a weight two layers share) differs by far more.
MERGE_RTOL = 1e-4
PROBE_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    """What `keel export` was asked for (see the module docstring for the sources)."""

    model: str
    adapter: str | None = None
    out: Path
    dtype: str | None = None  # bfloat16 | float16 | float32; None: the base model's
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE  # bytes, or "5GB"
    cache_dir: str | Path = "~/.cache/keel"


@dataclass(frozen=True)
class Sources:
    """Where each part of the exported model comes from, resolved to local folders."""

    base_dir: Path
    adapter_dir: Path | None  # a PEFT adapter folder
    checkpoint: TrainingCheckpoint | None  # or a training checkpoint
    tokenizer_dir: Path


def export_model(request: ExportRequest, log: Log = print) -> Path:
    """Write the merged model of `request` to `request.out`; returns that folder.

    Nothing is written to `out` unless the whole export succeeds: it is built in a temporary
    folder beside `out` and renamed at the end. A non-empty `out` is refused, untouched.
    """
    target_dtype = _parse_dtype(request.dtype)
    out = _check_out(Path(request.out).expanduser())
    sources = resolve_sources(request.model, request.adapter, request.cache_dir, log)
    tokenizer = load_tokenizer(sources.tokenizer_dir)
    if not tokenizer.chat_template:
        log(f"note: the tokenizer in {sources.tokenizer_dir} has no chat template")
    model, base_dtype, merge_diff = build_merged_model(sources, log)
    dtype = target_dtype or base_dtype
    _cast(model, dtype)
    _stop_at_end_of_turn(model, tokenizer)
    provenance = {
        "base": str(sources.base_dir),
        "adapter": str(sources.adapter_dir) if sources.adapter_dir else None,
        "checkpoint": str(sources.checkpoint.path) if sources.checkpoint else None,
        "dtype": str(dtype).removeprefix("torch."),
        "merge_max_abs_logit_diff": merge_diff,
        "keel_version": __version__,
    }

    def write(folder: Path) -> None:
        model.save_pretrained(str(folder), max_shard_size=request.max_shard_size)
        # The template goes into tokenizer_config.json, which every transformers version
        # (and llama.cpp's converter) reads; only newer ones read chat_template.jinja.
        tokenizer.save_pretrained(str(folder), save_jinja_files=False)
        add_legacy_keys(folder)  # so that transformers 4.x readers load it too
        (folder / MARKER_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        card = export_card(request.model, request.adapter, provenance["dtype"])
        write_model_card(folder, card, shown_as=out)

    write_folder_atomically(out, write, log)
    log(f"exported {provenance['dtype']} model -> {out}")
    return out


def build_merged_model(sources: Sources, log: Log):
    """(the fp32 model with any adapter merged in, the base's stored dtype, the probe's max
    |logit diff| between merged and unmerged, or None when nothing was merged)."""
    model, base_dtype = _load_base(sources.base_dir)
    if sources.adapter_dir is not None:
        log(f"loading adapter {sources.adapter_dir} on {sources.base_dir}")
        model = _attach_adapter(model, sources.adapter_dir, sources.base_dir)
    elif sources.checkpoint is not None:
        log(f"loading {sources.checkpoint.describe()} on {sources.base_dir}")
        model = load_checkpoint_weights(model, sources.checkpoint, sources.base_dir, log)
    if not _is_peft(model):
        return model, base_dtype, None
    if _untie_adapted_embeddings(model):
        log(
            "the adapter changes the input embeddings or the output layer, which the base "
            "shares (tied): the export gets its own output layer (tie_word_embeddings false)"
        )
    model, merge_diff = _merge_checked(model)
    log(f"merged: max |logit diff| vs. the unmerged adapter {merge_diff:.2e} (fp32)")
    return model, base_dtype, merge_diff


def resolve_sources(model: str, adapter: str | None, cache_dir: str | Path, log: Log) -> Sources:
    """Classify `--model` and `--adapter` and find the base model folder.

    Raises ModelError (or CheckpointError) naming the flag, the path and the fix.
    """
    model_dir = None if model.startswith(BUNDLED_PREFIX) else Path(model).expanduser()
    if model_dir is not None:
        refuse_unfinished_run(model_dir, "--model")
        if is_checkpoint(model_dir):
            _refuse_both(model, adapter, "a training checkpoint")
            checkpoint = read_checkpoint(model_dir)
            base_dir = _trained_base(checkpoint, cache_dir, log)
            return Sources(
                base_dir=base_dir, adapter_dir=None, checkpoint=checkpoint, tokenizer_dir=base_dir
            )
    adapter_dir = Path(adapter).expanduser() if adapter else None
    if adapter_dir is not None:
        refuse_unfinished_run(adapter_dir, "--adapter")
        if is_checkpoint(adapter_dir):
            checkpoint = read_checkpoint(adapter_dir)
            base_dir = resolve_model_path(model, cache_dir, log)
            return Sources(
                base_dir=base_dir, adapter_dir=None, checkpoint=checkpoint, tokenizer_dir=base_dir
            )
        _check_adapter_dir(adapter_dir)
    revision = "main"
    if model_dir is not None and (model_dir / "adapter_config.json").is_file():
        _refuse_both(model, adapter, "an adapter")
        adapter_dir = model_dir
        model, revision = adapter_base(adapter_dir)
    base_dir = resolve_model_path(model, cache_dir, log, revision=revision)
    tokenizer_dir = base_dir
    if adapter_dir is not None and (adapter_dir / "tokenizer_config.json").is_file():
        tokenizer_dir = adapter_dir  # keel saves the tokenizer it trained with beside the adapter
    return Sources(
        base_dir=base_dir, adapter_dir=adapter_dir, checkpoint=None, tokenizer_dir=tokenizer_dir
    )


def _refuse_both(model: str, adapter: str | None, what: str) -> None:
    if adapter is not None:
        raise ModelError(
            f"--model {model} is {what}, so it cannot take --adapter {adapter} as well; pass "
            f"the base model as --model with --adapter {adapter}, or drop --adapter"
        )


def _check_adapter_dir(adapter_dir: Path) -> None:
    if not adapter_dir.is_dir():
        raise ModelError(f"--adapter {adapter_dir}: no such folder")
    if not (adapter_dir / "adapter_config.json").is_file():
        full = (adapter_dir / "config.json").is_file()
        hint = (
            f"it holds a full model: export it with --model {adapter_dir} and no --adapter"
            if full
            else "give a PEFT adapter folder, the output.dir of a LoRA run, or one of its "
            "checkpoints/step-N folders"
        )
        raise ModelError(f"--adapter {adapter_dir} has no adapter_config.json; {hint}")
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise ModelError(
            f"--adapter {adapter_dir} has no adapter_model.safetensors (keel reads no pickled "
            f"weights such as adapter_model.bin); re-save the adapter with "
            f"save_pretrained(safe_serialization=True)"
        )
    read_checked(adapter_dir / "adapter_model.safetensors")  # truncated: name it, no traceback


def _trained_base(checkpoint: TrainingCheckpoint, cache_dir: str | Path, log: Log) -> Path:
    if not checkpoint.base:
        raise ModelError(
            f"{checkpoint.path} does not record its model; pass it with "
            f"--model BASE --adapter {checkpoint.path}"
        )
    if not checkpoint.base.startswith(BUNDLED_PREFIX) and not Path(checkpoint.base).is_dir():
        raise ModelError(
            f"{checkpoint.path} was trained on {checkpoint.base}, which is not there any "
            f"more; pass the base model with --model BASE --adapter {checkpoint.path}"
        )
    return resolve_model_path(checkpoint.base, cache_dir, log)


def _parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ModelError(
            f"--dtype {name}: not a dtype keel exports; use one of {', '.join(DTYPES)}, or "
            f"leave it out to keep the base model's"
        )
    return DTYPES[name]


def _check_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise ModelError(f"--out {out} is a file; give a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ModelError(
            f"--out {out} is not empty; keel export never overwrites: give a new folder, "
            f"or delete {out} first"
        )
    return out


def _load_base(base_dir: Path):
    """The base model in fp32 and the dtype it is stored in (the default output dtype)."""
    model = load_model(base_dir, dtype=None)  # as stored, so its dtype can be read
    stored = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return model.float().eval(), stored


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _attach_adapter(model, adapter_dir: Path, base_dir: Path):
    """`model` wrapped in the PEFT adapter saved in `adapter_dir`, every weight checked."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    mismatch = f"the adapter {adapter_dir} does not fit the base model {base_dir}"
    fix = "pass the model the adapter was trained on as --model"
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as exc:  # size mismatch, missing modules
        first = str(exc).strip().splitlines()[0:3]
        raise ModelError(f"{mismatch} ({' '.join(first)}); {fix}") from None
    # PEFT loads leniently: weights for modules the base lacks (more layers, other names)
    # are skipped with at most a warning. Every stored weight must land somewhere.
    expected = set(get_peft_model_state_dict(peft_model))
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    problems = [
        f"{len(names)} {what} (e.g. {', '.join(names[:2])})"
        for what, names in (
            ("stored weight(s) match no module of the base", sorted(stored - expected)),
            ("adapter weight(s) are not in the file", sorted(expected - stored)),
        )
        if names
    ]
    if problems:
        raise ModelError(f"{mismatch}: {'; '.join(problems)}; {fix}")
    return peft_model.eval()


def _untie_adapted_embeddings(peft_model) -> bool:
    """Give the output layer its own copy of a tied embedding matrix the adapter changes.

    Unmerged, a LoRA on the input embeddings changes only the lookup, while the output
    layer keeps using the shared matrix (and the reverse for a LoRA on the output layer).
    Merging into the shared matrix would change both, so they are untied first.
    """
    lm = peft_model.get_base_model()
    layers = (lm.get_input_embeddings(), lm.get_output_embeddings())
    if layers[1] is None or not any(hasattr(layer, "base_layer") for layer in layers):
        return False
    embeddings, output = (getattr(layer, "base_layer", layer) for layer in layers)
    if embeddings.weight is not output.weight:
        return False
    output.weight = torch.nn.Parameter(output.weight.detach().clone(), requires_grad=False)
    lm.config.get_text_config().tie_word_embeddings = False
    lm.config.tie_word_embeddings = False
    return True


def _probe_ids(model) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    return (torch.arange(PROBE_TOKENS) * 7919 % vocab).unsqueeze(0)  # [1, T], spread over vocab


def _merge_checked(peft_model) -> tuple[torch.nn.Module, float]:
    """Merge the adapter into the base weights; refuse if the logits change doing so."""
    ids = _probe_ids(peft_model)
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids, use_cache=False).logits  # [1, T, V]
        try:
            merged_model = peft_model.merge_and_unload()
        except (AttributeError, NotImplementedError, ValueError) as exc:  # e.g. prompt tuning
            kind = getattr(peft_model.active_peft_config.peft_type, "value", "this")
            raise ModelError(
                f"a {kind} adapter cannot be merged into the weights ({exc}); export merges "
                f"LoRA-style adapters only"
            ) from None
        merged = merged_model(input_ids=ids, use_cache=False).logits  # [1, T, V]
    diff = (merged - unmerged).abs().max().item()
    scale = max(unmerged.abs().max().item(), 1.0)
    if not diff <= MERGE_RTOL * scale:
        raise ModelError(
            f"merging the adapter changed the model's outputs (max |logit diff| {diff:.3g} "
            f"where {MERGE_RTOL * scale:.3g} is allowed), so nothing was written; serve base + "
            f"adapter unmerged instead (`keel chat --adapter`)"
        )
    return merged_model, diff


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
