"""The exported model: the base in fp32, an adapter or checkpoint weights on it, merged and
checked (the merged model's logits must equal the unmerged one's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from keel.checkpoint.source import load_checkpoint_weights
from keel.errors import ModelError
from keel.export.probe import probe_inputs
from keel.export.sources import Sources
from keel.models.adapters import saves_embedding_layers
from keel.models.loading import load_model
from keel.models.vocabulary import fit_vocabulary

Log = Callable[[str], None]
# Largest |merged - unmerged| logit accepted, relative to the largest |logit| (at least 1).
# Both run in fp32, so correct merges differ by round-off (~1e-6); a merge that went wrong
# (e.g. into a weight two layers share) differs by far more.
MERGE_RTOL = 1e-4


def build_merged_model(sources: Sources, tokenizer, log: Log):
    """(the fp32 model with any adapter merged in, the base's stored dtype, the probe's max
    |logit diff| between merged and unmerged, or None when nothing was merged).
    `tokenizer` spells a vision-language probe's image tokens (keel.export.probe)."""
    model, base_dtype = load_base(sources.base_dir)
    fit_vocabulary(model, tokenizer, log)  # the rows a run that added tokens trained
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
    model, merge_diff = _merge_checked(model, probe_inputs(model, sources.base_dir, tokenizer, log))
    log(f"merged: max |logit diff| vs. the unmerged adapter {merge_diff:.2e} (fp32)")
    return model, base_dtype, merge_diff


def load_base(base_dir: Path):
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
    saved_as = saves_embedding_layers(peft_model)
    expected = set(get_peft_model_state_dict(peft_model, save_embedding_layers=saved_as))
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


def _merge_checked(peft_model, probe: dict) -> tuple[torch.nn.Module, float]:
    """Merge the adapter into the base weights; refuse if the logits on the `probe` inputs
    change doing so."""
    with torch.no_grad():
        unmerged = peft_model(**probe, use_cache=False).logits  # [1, T, V]
        try:
            merged_model = peft_model.merge_and_unload()
        except (AttributeError, NotImplementedError, ValueError) as exc:  # e.g. prompt tuning
            kind = getattr(peft_model.active_peft_config.peft_type, "value", "this")
            raise ModelError(
                f"a {kind} adapter cannot be merged into the weights ({exc}); export merges "
                f"LoRA-style adapters only"
            ) from None
        merged = merged_model(**probe, use_cache=False).logits  # [1, T, V]
    diff = (merged - unmerged).abs().max().item()
    scale = max(unmerged.abs().max().item(), 1.0)
    if not diff <= MERGE_RTOL * scale:
        raise ModelError(
            f"merging the adapter changed the model's outputs (max |logit diff| {diff:.3g} "
            f"where {MERGE_RTOL * scale:.3g} is allowed), so nothing was written; serve base + "
            f"adapter unmerged instead (`keel chat --adapter`)"
        )
    return merged_model, diff
