"""Which of a model's modules tensor parallelism splits, and why a model cannot be split:
transformers' own plan for it (`config.base_model_tp_plan`), checked against its layers
(keel.distributed.tensor_parallel applies it)."""

from __future__ import annotations

from torch import nn

from keel.config.schema import DistributedConfig
from keel.distributed.tensor_parallel import COLWISE, PARTIAL_GRAD, ROWWISE, TensorPlan
from keel.errors import ModelError
from keel.models.attention import context_parallel_problem
from keel.models.trainable import decoder_layers

_LAYER_PREFIX = "layers.*."


def tensor_plan(model: nn.Module, size: int) -> tuple[TensorPlan | None, str | None]:
    """(`model`'s tensor-parallel plan, None), or (None, why it cannot split `size` ways).
    `model` is the causal LM; a vision-language model's language model splits (its plan is
    its text config's), its vision tower and projector stay whole on every process."""
    key = f"distributed.tensor_parallel = {size}"
    name = type(model).__name__
    config = model.config
    text = config.get_text_config()
    planned = getattr(text, "base_model_tp_plan", None) or {}
    layered = {
        k[len(_LAYER_PREFIX) :]: v for k, v in planned.items() if k.startswith(_LAYER_PREFIX)
    }
    if not layered:
        return None, (
            f"{key}: transformers has no tensor-parallel plan for {name} "
            f"({getattr(text, 'model_type', '?')}); use distributed.tensor_parallel 1"
        )
    layers = list(decoder_layers(model) or [])
    present = {path for layer in layers for path, _ in layer.named_modules()}
    used = {path: style for path, style in layered.items() if path in present}
    if not any(style in (COLWISE, ROWWISE) for style in used.values()):
        return None, (
            f"{key}: none of the modules transformers' plan for {name} splits "
            f"({', '.join(layered)}) is in its decoder layers; use distributed.tensor_parallel 1"
        )
    odd = {
        path: style for path, style in used.items() if style not in (COLWISE, ROWWISE, PARTIAL_GRAD)
    }
    if odd:
        path, style = next(iter(odd.items()))
        return None, (
            f"{key}: {name}'s layers are planned with styles keel does not split "
            f"({path}: {style}, e.g. a mixture of experts); keel splits dense attention and "
            f"MLP projections. Use distributed.tensor_parallel 1 (FSDP2 shards the experts)"
        )
    heads = {
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None),
    }
    for field_name, count in heads.items():
        if isinstance(count, int) and count % size:
            return None, (
                f"{key}: {name} has {field_name} {count}, which does not split over {size} "
                f"processes; use a divisor of {count}"
            )
    for layer in layers:
        modules = dict(layer.named_modules())
        for path, style in used.items():
            if style == PARTIAL_GRAD or path not in modules:
                continue
            linear = getattr(modules[path], "base_layer", modules[path])  # under a LoRA adapter
            if not isinstance(linear, nn.Linear):
                return (
                    None,
                    f"{key}: {name}'s {path} is a {type(linear).__name__}, not a linear layer",
                )
            features = linear.weight.shape[0 if style == COLWISE else 1]
            if features % size:
                return None, (
                    f"{key}: {name}'s {path} has {features} "
                    f"{'output' if style == COLWISE else 'input'} features, which do not split "
                    f"over {size} processes"
                )
    styles = {p: s for p, s in used.items() if s != PARTIAL_GRAD}
    partial = tuple(p for p, s in used.items() if s == PARTIAL_GRAD)
    return TensorPlan(styles, partial), None


def required_tensor_plan(model: nn.Module, size: int) -> TensorPlan:
    """`tensor_plan`'s plan, or ModelError with why `model` cannot split `size` ways."""
    plan, problem = tensor_plan(model, size)
    if problem:
        raise ModelError(problem)
    return plan


def split_problems(model: nn.Module, distributed: DistributedConfig) -> list[str]:
    """Why `model` cannot split as `distributed` asks: its rows' tokens over a context-
    parallel group, or its layers over a tensor-parallel one ([]: it can, or neither)."""
    tp = distributed.tensor_parallel
    found = [context_parallel_problem(model, distributed.context_parallel)]
    found += [tensor_plan(model, tp)[1] if tp > 1 else None]
    return [problem for problem in found if problem]


def one_process_part(model: nn.Module, plan: TensorPlan, size: int) -> None:
    """Shrink `model` (on the meta device) in place to what one process of a group of
    `size` holds of each split layer: colwise weights and biases 1/size of the rows,
    rowwise weights 1/size of the columns. An adapter applied afterwards gets one process's
    shapes too (lora_B of a colwise layer, lora_A of a rowwise one split); for the memory
    planner, which counts it as it counts a whole model."""
    import torch

    for layer in decoder_layers(model) or []:
        modules = dict(layer.named_modules())
        for path, style in plan.styles.items():
            linear = modules.get(path)
            if linear is None:
                continue
            dim = 0 if style == COLWISE else 1
            for name in ("weight", "bias") if dim == 0 else ("weight",):
                old = getattr(linear, name)
                if old is None:
                    continue
                shape = list(old.shape)
                shape[dim] //= size
                new = torch.empty(shape, dtype=old.dtype, device="meta")
                setattr(linear, name, nn.Parameter(new, requires_grad=old.requires_grad))
            if dim == 0:
                linear.out_features //= size
            else:
                linear.in_features //= size
