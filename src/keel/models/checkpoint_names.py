"""Which checkpoint tensor fills which model tensor, when the two names differ.

transformers 5 renames some families' tensors while it loads them: a Qwen2-VL checkpoint
on the Hub stores `model.layers.*` and `visual.*`, LLaVA `language_model.model.*` and
`vision_tower.*`, while the 5.x module tree has `model.language_model.*`, `model.visual.*`
(and `save_pretrained` writes the old names back). keel's tensor-by-tensor loader asks
transformers for the same renamings (its conversion mapping for the model) and applies them
to the checkpoint's names, so both spellings load. Conversions that change tensors (fused
per-expert MoE weights, split or concatenated projections) are not renamings; a checkpoint
that needs one is refused (see `stored_names`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from keel.errors import ModelError


def stored_names(
    model: nn.Module, model_names: Iterable[str], keys: Iterable[str]
) -> dict[str, str]:
    """{model tensor name: checkpoint key} for every checkpoint key whose name transformers
    renames into one of `model_names` (the model's own, unprefixed names); names stored as
    they are need no entry. `model` is the Hugging Face model (not a PEFT wrapper).

    Raises ModelError when a checkpoint key needs a conversion other than a renaming.
    """
    renamings, converters = _transforms(model)
    if not renamings and not converters:
        return {}
    from transformers.core_model_loading import rename_source_key

    wanted = dict.fromkeys(model_names, True)  # transformers probes it with .get(name)
    prefix = getattr(model, "base_model_prefix", None) or None
    found: dict[str, str] = {}
    for key in keys:
        if key in wanted:
            continue  # already in the model's spelling (a checkpoint saved in new names)
        renamed, converted_by = rename_source_key(key, renamings, converters, prefix, wanted)
        if converted_by is not None:
            model_type = getattr(model.config, "model_type", "?")
            raise ModelError(
                f"transformers converts {model_type} checkpoints while loading them (tensor "
                f"{key} is {_describe(converted_by)}), a conversion keel's loader does not do: "
                f"keel cannot train model_type {model_type} yet"
            )
        if renamed != key and renamed in wanted:
            found.setdefault(renamed, key)
    return found


def _transforms(model: nn.Module) -> tuple[list, list]:
    """transformers' (renamings, converters) for `model`; ([], []) where it has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # an older transformers: it renames nothing either
        return [], []
    try:
        mapping = get_model_conversion_mapping(model, add_legacy=False)
    except (TypeError, AttributeError):  # not a PreTrainedModel (e.g. a test's own module)
        return [], []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    return renamings, converters


def _describe(pattern: str) -> str:
    return f"fused or split by the pattern {pattern!r}"
