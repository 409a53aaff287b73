"""LoRA on a mixture-of-experts model: what it adapts, and what it leaves to full training.

transformers 5 holds a layer's routed experts as one [experts, ...] parameter per
projection, not as Linear modules. PEFT reads LoRA target names as transformers 4 spelled
these models (`gate_proj`, `w1`, the router `gate`) and then wraps the fused expert
parameters themselves (its ParamWrapper). keel's LoRA targets adapt Linear modules only
(attention, and shared experts where PEFT leaves them alone), and say so; the fused
experts are adapted when method.lora.target_parameters names them (PEFT's
target_parameters: rank r per expert, no dropout), or train with method.type full or
freeze.
"""

from __future__ import annotations

import torch

from keel.errors import ModelError


def retargeted_names(model: torch.nn.Module) -> set[str]:
    """The target names PEFT turns into this model's fused experts or router (their
    transformers 4 names); empty for a model it does not retarget."""
    try:
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:  # a PEFT without the conversion wraps Linear modules only
        return set()
    config = getattr(model, "config", None)
    pattern = _MODEL_TO_CONVERSION_PATTERN.get(getattr(config, "model_type", None))
    return set(_MOE_TARGET_MODULE_MAPPING.get(pattern, {}))


def fused_experts(model: torch.nn.Module) -> list[str]:
    """Short names of the model's fused expert parameters (e.g. experts.gate_up_proj)."""
    names = {".".join(name.split(".")[-2:]) for name, p in model.named_parameters() if p.dim() == 3}
    return sorted(n for n in names if n.startswith("experts."))


def linear_targets(model: torch.nn.Module) -> list[str]:
    """What "all-linear" means for a model PEFT retargets: its Linear modules' short names
    but the output layer's and those PEFT would read as experts or router."""
    output = model.get_output_embeddings()
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and isinstance(module, torch.nn.Linear) and module is not output
    }
    return sorted(names - retargeted_names(model))


def expert_target_problems(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Why method.lora.target_parameters cannot adapt `model`: a name that ends no fused
    expert parameter's name (PEFT matches a dotted suffix), or a model without them."""
    if not names:
        return []
    fused = [name for name, p in model.named_parameters() if p.dim() == 3 and ".experts." in name]
    if not fused:
        return [
            f"method.lora.target_parameters = {names}: {type(model).__name__} has no fused "
            f"routed experts (a mixture of experts as transformers 5 holds them); remove it"
        ]
    unknown = [n for n in names if not any(f == n or f.endswith("." + n) for f in fused)]
    if not unknown:
        return []
    return [
        f"method.lora.target_parameters: {', '.join(unknown)} names no fused expert weight of "
        f"{type(model).__name__}; it has {', '.join(fused_experts(model))}"
    ]


def check_no_wrapped_experts(peft_model: torch.nn.Module, targeted: list[str]) -> None:
    """PEFT wrapped no parameter directly but those method.lora.target_parameters names (a
    safety net for a PEFT that retargets more names than `retargeted_names` knows)."""
    wrapped = [
        (name.replace(".base_layer", ""), m.parameter_name)
        for name, m in peft_model.named_modules()
        if type(m).__name__ == "ParamWrapper"
    ]
    unasked = [
        name
        for name, parameter in wrapped
        if not any(f"{name}.{parameter}".endswith(t) for t in targeted)
    ]
    if unasked:
        raise ModelError(
            f"PEFT wrapped this mixture-of-experts model's fused expert parameters "
            f"({unasked[0]}, ...), which method.lora.target_parameters does not name; list "
            f"method.lora.targets without them (e.g. [q_proj, k_proj, v_proj, o_proj]), or "
            f"name them in method.lora.target_parameters"
        )
