"""Quantization-aware training (torchao): linear layers compute with their weights (and
activations) rounded exactly as a post-training quantization scheme will round them, and
the straight-through gradient trains the full-precision weights under that rounding.

The rounding is derived from the scheme's own torchao config (torchao's QATConfig with a
base config), so what trained is what the scheme's quantization produces: `keel export
--quantize` applies that same config, to the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from keel.quant import import_torchao

NEEDED_FOR = "method.qat (quantization-aware training)"


@dataclass(frozen=True)
class Scheme:
    """A post-training quantization scheme QAT can train for."""

    summary: str  # what is rounded to what, for the log and the docs
    grouped: bool  # weights are scaled in groups of method.qat.group_size input features


SCHEMES = {
    "int8-int4": Scheme(
        "int8 activations (dynamic, per token) and int4 weights (symmetric, per group): "
        "torchao's Int8DynamicActivationIntxWeightConfig, for CPUs and ExecuTorch",
        grouped=True,
    ),
    "int4": Scheme(
        "int4 weights only (per group), activations as trained: torchao's "
        "Int4WeightOnlyConfig, for CUDA GPUs",
        grouped=True,
    ),
    "fp8": Scheme(
        "float8 e4m3 activations (dynamic) and weights, per tensor: torchao's "
        "Float8DynamicActivationFloat8WeightConfig, for GPUs with fp8 matmuls (H100 on)",
        grouped=False,
    ),
}


def torchao_config(scheme: str, group_size: int):
    """The torchao post-training quantization config of `scheme` (keel's names above)."""
    import torch

    quantization = import_torchao("quantization", needed_for=NEEDED_FOR)
    if scheme == "int8-int4":
        from torchao.quantization.granularity import PerGroup

        return quantization.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)
        )
    if scheme == "int4":
        return quantization.Int4WeightOnlyConfig(group_size=group_size)
    if scheme == "fp8":
        return quantization.Float8DynamicActivationFloat8WeightConfig()
    raise ValueError(f"unknown QAT scheme {scheme!r}")


def prepare(layers: nn.ModuleList, scheme: str, group_size: int) -> int:
    """Swap every nn.Linear in the decoder `layers` for torchao's FakeQuantizedLinear with
    `scheme`'s rounding; returns how many. The new modules keep the very parameters of the
    old (also on the meta device, where torchao would make new ones): ties, requires_grad
    and checkpoint names stay as they were."""
    api = import_torchao("quantization.qat", needed_for=NEEDED_FOR)
    quantization = import_torchao("quantization", needed_for=NEEDED_FOR)
    config = api.QATConfig(torchao_config(scheme, group_size), step="prepare")
    count = 0
    for layer in layers:
        kept = {
            name: (module.weight, module.bias)
            for name, module in layer.named_modules()
            if isinstance(module, nn.Linear)
        }
        quantization.quantize_(layer, config, filter_fn=lambda m, _n: isinstance(m, nn.Linear))
        for name, (weight, bias) in kept.items():
            swapped = layer.get_submodule(name)
            swapped.weight, swapped.bias = weight, bias
        count += len(kept)
    return count


def set_fake_quantization(model: nn.Module, enabled: bool) -> None:
    """Turn the rounding of every fake-quantized layer in `model` on or off
    (method.qat.start_step: the steps before it train in full precision)."""
    for module in model.modules():
        for part in ("weight_fake_quantizer", "activation_fake_quantizer"):
            quantizer = getattr(module, part, None)
            if quantizer is not None and hasattr(quantizer, "enabled"):
                quantizer.enabled = enabled
