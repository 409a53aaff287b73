"""Tensor parallelism: each decoder layer's attention heads and MLP columns split over a
group of consecutive processes (distributed.tensor_parallel), applied from outside the
model, on its meta-device copy, before FSDP2 shards it over the data-parallel axis.

The layout is transformers' own plan for the model (`config.base_model_tp_plan`), built
with PyTorch's DTensor styles:
- colwise projections (q, k, v, gate, up) split their output features: each process
  computes its heads and its columns of the MLP, from the whole input;
- rowwise projections (o, down) split their input features: the partial outputs are
  summed over the group (one all-reduce after attention and one after the MLP; backward
  adds one for each colwise layer's input gradient);
- everything else (embeddings, norms, the output layer) stays whole on each process of
  the group. Its gradients come out whole and equal on each, because every colwise layer's
  input gradient is all-reduced, so nothing more is summed for them;
- per-head norms (Qwen3's q_norm and k_norm, planned "replicated_with_grad_allreduce") see
  only their process's heads: their gradients are summed over the group once per optimizer
  step (`sum_partial_grads`).
LoRA on a split projection follows it: colwise, the base layer and lora_B split their
outputs and lora_A stays whole; rowwise, the base layer and lora_A split their inputs and
lora_B stays whole (the rank-r sum costs one small all-reduce).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from keel.distributed.process_group import all_reduce_together

COLWISE, ROWWISE = "colwise", "rowwise"
# a module whose weight every process holds whole but whose gradient each computes from
# its own heads only
PARTIAL_GRAD = "replicated_with_grad_allreduce"


@dataclass(frozen=True)
class TensorPlan:
    """Which modules of a decoder layer split, by their path inside the layer."""

    styles: dict[str, str]  # "self_attn.q_proj" -> colwise | rowwise
    partial: tuple[str, ...]  # modules whose gradients are summed over the group


def apply_tp(units: Iterable[nn.Module], mesh: DeviceMesh, plan: TensorPlan) -> None:
    """Split each of `units` (decoder layers; others hold none of the plan's modules) over
    the 1-D tensor-parallel `mesh`, in place; works on the meta device."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # DTensor warns each time a (dp, tp) tensor is reduced or gathered in two collectives,
    # one per axis (the gradient norm each step, the final weights' gather): a
    # performance note about two small collectives, not the user's concern.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    make = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    for unit in units:
        modules = dict(unit.named_modules())
        styles = {}
        for path, style in plan.styles.items():
            if path not in modules:
                continue
            for part, part_style in _parts(modules[path], path, style):
                styles[part] = make[part_style]()
        if styles:
            parallelize_module(unit, mesh, styles)


def _parts(module: nn.Module, path: str, style: str) -> list[tuple[str, str]]:
    """The linear layers that carry `style` for the planned module at `path`: the module
    itself, or for a PEFT LoRA layer its base layer and the adapter factor on the split
    side (lora_B of a colwise layer, lora_A of a rowwise one)."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return [(path, style)]
    factor = "lora_B" if style == COLWISE else "lora_A"
    adapters = getattr(module, factor, {})
    parts = [(f"{path}.base_layer", style)]
    parts += [(f"{path}.{factor}.{name}", style) for name in adapters]
    return parts


def partial_parameters(units: Iterable[nn.Module], plan: TensorPlan) -> list[nn.Parameter]:
    """The trainable parameters of the plan's per-head modules in `units`: their gradients
    need `sum_partial_grads`."""
    found = []
    for unit in units:
        modules = dict(unit.named_modules())
        for path in plan.partial:
            if path in modules:
                found += [p for p in modules[path].parameters() if p.requires_grad]
    return found


def sum_partial_grads(params: Sequence[nn.Parameter], group) -> None:
    """Sum the gradients of per-head modules over the tensor-parallel `group`: one
    all-reduce per optimizer step, after the window's last backward (every process of the
    group ran the same micro-batches, so each has a gradient)."""
    grads = [p.grad for p in params if p.grad is not None]
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if group is not None and grads:
        all_reduce_together(grads, group)
