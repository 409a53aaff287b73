"""QLoRA at set-up: which backend stores the frozen base, in which compute dtype, and what
the log says about it.

keel.quant holds the low-bit storage formats (NF4, bitsandbytes 4-bit) and knows nothing of
models; this module plugs them into a model's decoder layers."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils.parametrize import register_parametrization
from torch.utils.checkpoint import checkpoint

from keel.config.schema import QloraConfig
from keel.config.validate_method import BNB_UNDER_FSDP
from keel.distributed.strategy import Strategy
from keel.errors import ConfigError
from keel.models.loading import torch_dtype
from keel.precision import Precision
from keel.quant.nf4 import StoredAs, empty_nf4_as, frozen_linears, is_nf4, quantize_on_meta


def compute_dtype(qlora: QloraConfig, precision: Precision) -> torch.dtype:
    """The dtype NF4 weights are dequantised to: method.qlora.compute_dtype, or with auto
    the training precision's matmul dtype (bf16 / fp16), else fp32."""
    if qlora.compute_dtype != "auto":
        return torch_dtype(qlora.compute_dtype)
    return precision.compute_dtype


def quantize_base(
    layers: nn.ModuleList, qlora: QloraConfig, precision: Precision, dist, strategy: Strategy, log
) -> None:
    """Make the frozen linear weights in the model's decoder `layers` (still on the meta
    device, LoRA applied) low-bit as method.qlora says; log what was and was not."""
    dtype = compute_dtype(qlora, precision)
    dtype_name = str(dtype).removeprefix("torch.")
    if dist.device.type == "cpu" and dtype == torch.float16:
        raise ConfigError(
            [
                "method.qlora.compute_dtype = float16 is not supported on a CPU (slow or "
                "missing fp16 matmuls); use bfloat16, float32 or auto"
            ]
        )
    if qlora.quant_backend == "bnb":
        if strategy.shards:
            raise ConfigError([BNB_UNDER_FSDP])
        from keel.quant import bnb

        names = bnb.quantize_on_meta(frozen_linears(layers), dtype, dist.device)
        log(
            f"QLoRA: {len(names)} frozen linear weights stored in NF4 (bitsandbytes "
            f"Linear4bit, its CPU AVX512-BF16 repacking off), dequantised to "
            f"{dtype_name} per matmul"
        )
        return
    world = dist.dims.dp_shard if strategy.shards else 1  # NF4 blocks split over the shards
    if qlora.quantize_experts:
        quantize_experts(layers, dtype, world, log)
    quantized, kept = quantize_on_meta(layers, dtype, world)
    if not quantized:
        raise ConfigError(
            [
                f"method.type = qlora: none of the model's frozen linear weights can be "
                f"stored in NF4 ({len(kept)} kept: their sizes are not multiples of 64 "
                f"values{' split evenly over the processes' if world > 1 else ''}); use "
                f"method.type lora"
            ]
        )
    short = sorted({name.replace(".base_layer", "").rsplit(".", 2)[-2] for name in quantized})
    log(
        f"QLoRA: {len(quantized)} frozen linear weights stored in NF4 (torchao; "
        f"{', '.join(short)}), dequantised to {dtype_name} per matmul"
    )
    if kept:
        shown = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
        reason = "do not split into whole NF4 blocks"
        if world > 1:
            reason += f" evenly over {world} processes"
        log(f"QLoRA: {len(kept)} kept in {dtype_name}: {shown} ({reason})")


def quantize_experts(layers: nn.ModuleList, dtype: torch.dtype, world: int, log) -> None:
    """method.qlora.quantize_experts: the frozen fused expert weights in `layers` (on the
    meta device) become NF4, read back through `StoredAs`; each experts block recomputes
    its forward in backward, so the dequantised weights live only while it runs."""
    quantized, kept = [], []
    for name, module in layers.named_modules():
        weights = [
            (attr, p)
            for attr, p in module.named_parameters(recurse=False)
            if p.dim() == 3 and not p.requires_grad
        ]
        for attr, param in weights:
            stored = empty_nf4_as(tuple(param.shape), dtype, world)
            if stored is None:
                param.data = param.data.to(dtype)
                kept.append(f"{name}.{attr}")
                continue
            setattr(module, attr, stored)
            register_parametrization(module, attr, StoredAs(param.shape), unsafe=True)
            quantized.append(f"{name}.{attr}")
        if weights:
            module.forward = functools.partial(_recomputed, module.forward)
    short = sorted({n.rsplit(".", 1)[-1] for n in quantized})
    log(
        f"QLoRA: {len(quantized)} frozen expert weights stored in NF4 ({', '.join(short)}), "
        f"dequantised to {str(dtype).removeprefix('torch.')} while their block runs"
    )
    if kept:
        log(f"QLoRA: {len(kept)} expert weights kept: {', '.join(kept[:4])} (not whole blocks)")


def _recomputed(forward, *args, **kwargs):
    """Run an experts block so that backward recomputes it: autograd keeps its inputs, not
    the dequantised [experts, ...] weights its matmuls read."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def quantized_names(module: nn.Module) -> list[str]:
    """Qualified names of `module`'s low-bit (NF4, bitsandbytes 4-bit) parameters."""
    return [
        name
        for name, param in module.named_parameters()
        if is_nf4(param) or type(param).__name__ == "Params4bit"
    ]
