"""What method.qat's rounding keeps for backward, for the activation formula
(keel.plan.activations): torchao's fake quantization saves its own tensors beside a plain
linear layer's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keel.plan.activations import Regime
    from keel.plan.census import LayerInfo

# method.qat: what torchao's rounding (0.18, keel.quant.qat) saves for backward beyond a
# plain linear layer's tensors, measured with autograd's saved-tensor hooks on random Llama
# models (fp32 and bf16 weights, bf16 autocast on fp32 weights, groups of 32 and 64; r: the
# weights' itemsize, g: the group size):
# - per weight element (whatever the tokens): the rounded copy (r) when the weight is
#   frozen; trained, int8-int4 2r + 2r/g (the copy, the scales, zero points and the
#   straight-through mask), int4 20 - r + 16/g and fp8 16 (fp32 intermediates). Under
#   autocast the rounded weight's compute-dtype copy replaces the weight's: r less;
# - per token and input feature, (trained, frozen) below; int8-int4 also keeps per-token
#   scales, 3r per linear layer.
_QAT_PER_INPUT = {  # (scheme, autocast on fp32 weights): bytes, as functions of r
    ("int8-int4", False): (lambda r: 1.5 * r, lambda r: r),
    ("int8-int4", True): (lambda r: 3.5, lambda r: 3.25),
    ("fp8", False): (lambda r: 16, lambda r: 16 - r / 2),
    ("fp8", True): (lambda r: 14.5, lambda r: 14.25),
}


def qat_weight_bytes(layer: LayerInfo, regime: Regime, qat: tuple[str, int] | None) -> int:
    """Bytes method.qat's rounding saves per block whatever the tokens (see above)."""
    if qat is None:
        return 0
    scheme, g = qat
    r = regime.residual
    trained = {"int8-int4": 2 * r + 2 * r / g, "int4": 20 - r + 16 / g, "fp8": 16}[scheme]
    copy = r if regime.weight_copies else 0  # autocast's copy of it replaces the weight's
    return int(
        sum(((trained if m.trainable else r) - copy) * m.weight_numel for m in layer.linears)
    )


def qat_per_token(layer: LayerInfo, regime: Regime, qat: tuple[str, int]) -> int:
    """Bytes per token method.qat's rounding saves in a block (see above)."""
    coefficients = _QAT_PER_INPUT.get((qat[0], regime.weight_copies))
    if coefficients is None:  # int4: the inputs are not rounded
        return 0
    r, (trained, frozen) = regime.residual, coefficients
    scales = 3 * r if qat[0] == "int8-int4" else 0
    return int(
        sum((trained if m.trainable else frozen)(r) * m.in_features + scales for m in layer.linears)
    )
