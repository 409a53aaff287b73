"""Which checkpoint tensors fill which model tensor, when the two names differ.

transformers 5 renames some families' tensors while it loads them: a Qwen2-VL checkpoint
on the Hub stores `model.layers.*` and `visual.*`, LLaVA `language_model.model.*` and
`vision_tower.*`, while the 5.x module tree has `model.language_model.*`, `model.visual.*`
(and `save_pretrained` writes the old names back). keel's tensor-by-tensor loader asks
transformers for the same renamings (its conversion mapping for the model) and applies them
to the checkpoint's names, so both spellings load.

Mixture-of-experts families (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek, ...) hold each layer's
experts as one [experts, ...] tensor, where their checkpoints store one tensor per expert
and projection (`experts.3.gate_proj.weight`, `experts.3.up_proj.weight`). transformers
stacks them while loading; keel does the same stacking (`StackedExperts`), reading only
the experts a process holds: sharding splits the fused tensor by experts, its first
dimension. Other conversions that change tensors are refused (see `stored_names`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from keel.errors import ModelError


@dataclass(frozen=True)
class StackedExperts:
    """A fused expert tensor as transformers builds it from per-expert checkpoint tensors:
    expert e is its tensors of each source pattern (`parts[p][e]`, e.g. gate then up)
    concatenated along their first dimension, and the experts are stacked along a new first
    dimension: [experts, sum of the parts' rows, ...]."""

    parts: tuple[tuple[str, ...], ...]  # per source pattern, the checkpoint keys by expert

    def shape(self, shape_of: Callable[[str], tuple[int, ...] | None]) -> tuple[int, ...] | None:
        """The fused shape; None when a part is missing or the parts do not line up."""
        firsts = [shape_of(part[0]) for part in self.parts]
        if any(not s for s in firsts) or len({s[1:] for s in firsts}) != 1:
            return None
        if any(shape_of(key) != first for part, first in zip(self.parts, firsts) for key in part):
            return None  # the experts of one part differ in shape
        return (len(self.parts[0]), sum(s[0] for s in firsts), *firsts[0][1:])

    def read(self, reader, region: tuple[slice, ...] | None) -> torch.Tensor:
        """The fused tensor, or only `region` of it, from `reader` (a CheckpointReader): only
        the experts in its first slice are read."""
        experts = range(len(self.parts[0]))
        if region is not None:
            experts = experts[region[0]]
        stacked = torch.stack(
            [torch.cat([reader.get(part[e]) for part in self.parts]) for e in experts]
        )
        return stacked if region is None else stacked[(slice(None), *region[1:])]


@dataclass
class StoredNames:
    """How the checkpoint's keys fill the model's tensors: a renamed key, or experts to
    stack, by the model tensor's own name; names stored as they are need neither."""

    renamed: dict[str, str]
    stacked: dict[str, StackedExperts]


def stored_names(model: nn.Module, model_names: Iterable[str], keys: Iterable[str]) -> StoredNames:
    """The checkpoint keys (`keys`) that transformers renames or stacks into one of
    `model_names` (the model's own, unprefixed names). `model` is the Hugging Face model
    (not a PEFT wrapper).

    Raises ModelError when a checkpoint key needs a conversion other than a renaming or
    stacking experts.
    """
    found = StoredNames({}, {})
    renamings, converters = _transforms(model)
    if not renamings and not converters:
        return found
    from transformers.core_model_loading import apply_renamings, rename_source_key

    wanted = dict.fromkeys(model_names, True)  # transformers probes it with .get(name)
    prefix = getattr(model, "base_model_prefix", None) or None
    owner = {pattern: c for c in converters for pattern in c.source_patterns}
    experts: dict[str, dict[str, dict[int, str]]] = {}  # target -> pattern -> expert -> key
    for key in keys:
        if key in wanted:
            continue  # already in the model's spelling (a checkpoint saved in new names)
        renamed, converted_by = rename_source_key(key, renamings, converters, prefix, wanted)
        if converted_by is not None:
            before = apply_renamings(key, renamings)  # the names a conversion is written for
            index = _expert_index(model, before, converted_by, owner[converted_by])
            experts.setdefault(renamed, {}).setdefault(converted_by, {})[index] = key
        elif renamed != key and renamed in wanted:
            found.renamed.setdefault(renamed, key)
    for target, by_pattern in experts.items():
        if target in wanted:
            found.stacked[target] = _stacked(target, by_pattern, owner)
    return found


def _stacked(target: str, by_pattern: dict, owner: dict) -> StackedExperts:
    converter = owner[next(iter(by_pattern))]
    parts = []
    for pattern in converter.source_patterns:  # their order is the concatenation's
        by_expert = by_pattern.get(pattern, {})
        if not by_expert or sorted(by_expert) != list(range(len(by_expert))):
            raise ModelError(
                f"{target}: the checkpoint's experts for {pattern!r} are "
                f"{sorted(by_expert) or 'missing'}, not 0..n-1; the checkpoint is incomplete"
            )
        parts.append(tuple(by_expert[e] for e in range(len(by_expert))))
    if len({len(p) for p in parts}) != 1:
        raise ModelError(f"{target}: the checkpoint holds a different number of experts per part")
    return StackedExperts(tuple(parts))


def _expert_index(model, key: str, pattern: str, converter) -> int:
    """The expert number in `key` (renamed), which `converter` (by `pattern`) stacks;
    ModelError for a conversion other than stacking experts (and concatenating their
    parts)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    stacking = ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if not stacking or found is None or len(converter.target_patterns) != 1:
        model_type = getattr(model.config, "model_type", "?")
        steps = " then ".join(name for name, _ in ops) or "a conversion"
        raise ModelError(
            f"transformers converts {model_type} checkpoints while loading them (tensor "
            f"{key} goes through {steps} by the pattern {pattern!r}), a conversion keel's "
            f"loader does not do: keel cannot train model_type {model_type} yet"
        )
    return int(found.group(1))


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
