"""Bytes adapters add to a step beyond what keel.plan.activations counts per token: DoRA's
weight copies and the moment its weight norm holds, LoRA on a mixture of experts' fused
weights, and OFT's rotations, each per decoder block."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from keel.plan.census import Census, LayerInfo, LinearInfo

if TYPE_CHECKING:
    from keel.plan.activations import Regime


def dora_transient_bytes(census: Census) -> int:
    """The most one DoRA layer's forward holds for a moment beyond what it saves: PEFT
    builds LoRA's weight by running the adapters on an identity matrix (in x in), then the
    weight plus it, scaled, to take its row norms (fp32, about three in x out tensors at
    once). 0 without DoRA."""
    return max(
        (
            4 * m.in_features * m.in_features + 3 * 4 * m.in_features * m.dora_features
            for layer in census.layers
            for m in layer.linears
            if m.dora_features
        ),
        default=0,
    )


def dora_weight_copies(layer: LayerInfo, regime: Regime) -> int:
    """Bytes a block's DoRA layers save whatever the tokens: with LoRA dropout, DoRA runs the
    base matmul again on the dropped-out input, and under autocast saves the weight's copy
    in the compute dtype for it."""
    if regime.compute == 4:
        return 0
    return sum(
        regime.compute * m.dora_features * m.in_features
        for m in layer.linears
        if m.dora_features and m.lora_dropout
    )


def expert_lora_weights(layer: LayerInfo, regime: Regime) -> int:
    """LoRA on the fused experts (PEFT's ParamWrapper): each forward forms W + BA, a copy of
    the block's expert weights in their dtype, which the grouped matmuls keep for backward
    (the frozen W alone would be kept as the parameter it is)."""
    experts = layer.experts
    if experts is None or not experts.lora_numel:
        return 0
    return regime.residual * experts.weight_numel


def oft_rotations(
    layer: LayerInfo, regime: Regime, needs_input_grad: Callable[[LinearInfo], bool]
) -> int:
    """Bytes a block's OFT layers save whatever the tokens. Each builds its rotation from r
    skew-symmetric b x b blocks (r = inputs / b): the Neumann series saves the skew matrix
    and its square and cube for their products (6 copies in the compute dtype when
    autocast casts both operands of each), the exact transform its solve's inputs, output
    and pivots; the rotation itself is saved for the input's gradient; the upper-triangle
    indices (two int64 per parameter) for the scatter that builds the skew matrix.
    `needs_input_grad(linear)`: whether the linear's input needs a gradient."""
    c, total = regime.compute, 0
    for m in layer.linears:
        if not m.oft_block:
            continue
        b = m.oft_block
        blocks = m.in_features * b  # r b^2 elements
        w = regime.adapters or m.oft_itemsize
        if m.oft_exact:  # the solve saves its output, the rotation
            total += 3 * w * blocks + 4 * m.in_features
        else:
            total += 6 * c * blocks if w > c else 3 * w * blocks
        if needs_input_grad(m) and (not m.oft_exact or w != c):
            total += c * blocks  # the rotation (the solve's output cast, under autocast)
        total += 8 * b * (b - 1)  # b(b-1)/2 parameters per block: a row and a column index
    return total
