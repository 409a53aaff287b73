"""Which parts of a vision-language model train: the vision tower, the projector, the LM.

A vision-language model is a language model fed by a vision encoder (the tower) through a
projector. Its family plugin (keel.models.vision) names the module paths of each part; the
run's `model.vision` section says whether the tower and the projector train:

- full and freeze: their parameters' requires_grad follows model.vision (the language model
  trains as the method says: all of it, or the last decoder layers).
- lora and qlora: adapters go on the language model only (PEFT `exclude_modules`, whatever
  method.lora.targets names); a tower or projector that trains is a PEFT `modules_to_save`
  module, so the adapter folder carries its trained weights and loads back on the base.
- always: the tower weights the forward never reads (`family.unused_parameters`, e.g.
  LLaVA's CLIP layers after `vision_feature_layer`) are frozen: they would get no gradient,
  which breaks DDP, and train nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from keel.config.schema import VisionConfig
from keel.models.materialize import checkpoint_key
from keel.models.vision import VisionFamily, family_of
from keel.models.vision.family import module_or_parameter

PARTS = ("tower", "projector", "language model")


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def vision_family(model: nn.Module) -> VisionFamily | None:
    """The model's vision-language family; None for a text model."""
    config = getattr(hf_model(model), "config", None)
    return None if config is None else family_of(config)


def _under(name: str, paths: Iterable[str]) -> bool:
    return any(name == path or name.startswith(path + ".") for path in paths)


def part_of(family: VisionFamily, param_name: str) -> str | None:
    """ "tower", "projector", "language model" or None (e.g. lm_head) for a parameter name
    (PEFT-wrapped names too)."""
    name = checkpoint_key(param_name)
    if _under(name, family.projector):  # first: Qwen2-VL's projector sits inside the tower
        return "projector"
    if _under(name, family.tower):
        return "tower"
    if _under(name, (family.language_model,)):
        return "language model"
    return None


def lora_exclusions(family: VisionFamily) -> str:
    """PEFT `exclude_modules` regex: every module inside the tower or the projector."""
    paths = "|".join(re.escape(p) for p in (*family.tower, *family.projector))
    return rf"(?:{paths})(?:\..*)?"


def trainable_vision_paths(family: VisionFamily, vision: VisionConfig) -> tuple[str, ...]:
    """Module paths of the tower and projector parts that model.vision lets train."""
    tower = () if vision.freeze_tower else family.tower
    projector = () if vision.freeze_projector else family.projector
    return (*tower, *projector)


def modules_to_save(model: nn.Module, family: VisionFamily, vision: VisionConfig) -> list[str]:
    """PEFT `modules_to_save` entries for the trainable tower and projector parts under
    LoRA. A module list (e.g. the tower's blocks) is listed by its blocks: PEFT wraps a
    module in a copy with the same call, and a wrapped list could not be iterated. A bare
    parameter (LLaVA-NeXT's image_newline) has no module for PEFT to wrap and save with the
    adapter: under LoRA it stays as the base model has it."""
    entries = []
    for path in trainable_vision_paths(family, vision):
        module = module_or_parameter(model, path)
        if isinstance(module, nn.Parameter):
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            entries += [f"{path}.{child}" for child, _ in module.named_children()]
        else:
            entries.append(path)
    return entries


def apply_vision_switches(
    model: nn.Module, family: VisionFamily, vision: VisionConfig, method_type: str
) -> None:
    """Set requires_grad of the tower and projector for method full or freeze (LoRA chose
    its trainable parts with modules_to_save); freeze the unused tower weights always.

    Under freeze the switches only add: a tower or projector module listed in
    method.freeze.trainable_modules trains whatever model.vision says."""
    frozen = {"tower": vision.freeze_tower, "projector": vision.freeze_projector}
    if method_type in ("full", "freeze"):
        for name, param in model.named_parameters():
            part = part_of(family, name)
            if part in frozen and (method_type == "full" or not frozen[part]):
                param.requires_grad_(not frozen[part])
    unused = family.unused_parameters(hf_model(model).config)
    for name, param in model.named_parameters():
        if _under(checkpoint_key(name), unused):
            param.requires_grad_(False)


def part_counts(model: nn.Module, family: VisionFamily) -> dict[str, tuple[int, int]]:
    """{part: (trainable, total) parameters} for the tower, the projector and the language
    model (PEFT's frozen originals of modules_to_save copies count once, as the base)."""
    counts = {part: [0, 0] for part in PARTS}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        part = part_of(family, name)
        if part is None or id(param) in seen:
            continue
        seen.add(id(param))
        if ".original_module." not in name:
            counts[part][1] += param.numel()
        if param.requires_grad:
            counts[part][0] += param.numel()
    return {part: (trainable, total) for part, (trainable, total) in counts.items()}


def describe_parts(model: nn.Module, family: VisionFamily) -> str:
    """One log line: each part's trainable and total parameters."""
    shown = ", ".join(
        f"{part} {trainable:,} of {total:,}"
        for part, (trainable, total) in part_counts(model, family).items()
    )
    return f"{family.name}: trainable parameters by part: {shown}"


def outside_vision(family: VisionFamily, module_names: list[str]) -> list[str]:
    """`module_names` (of the unwrapped model) without those inside the tower or projector."""
    paths = (*family.tower, *family.projector)
    return [name for name in module_names if not _under(name, paths)]
