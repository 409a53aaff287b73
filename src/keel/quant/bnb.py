"""QLoRA's frozen base with bitsandbytes (`method.qlora.quant_backend: bnb`): one process
or DDP only (see keel.config.validate_method.BNB_UNDER_FSDP).

The frozen decoder linears become `bnb.nn.Linear4bit` on the meta device with an empty
placeholder weight, so allocating the model allocates no full-precision copy of them;
loading then reads each weight, quantises it (or takes the checkpoint's own 4-bit codes
when it was saved pre-quantised by bitsandbytes) and installs the packed weight.

bitsandbytes repacks a 4-bit weight in place, for its AVX512-BF16 CPU kernel, the first
time the layer runs in eval mode without gradients; a later training forward then reads
the repacked bytes as if they were not, and trains on wrong weights without an error
(measured: step-3 loss 6.387 vs 6.290 after one evaluation). keel turns that repacking
off on every layer it builds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from keel.errors import ConfigError, ModelError

BNB_PIN = "bitsandbytes>=0.45"
_QUANT_STATE = "quant_state.bitsandbytes__nf4"  # marks a weight saved pre-quantised


def import_bnb():
    """`import bitsandbytes` (keel/__init__ quiets its CPU-kernel notice), or a ConfigError."""
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise ConfigError(
            [
                f"method.qlora.quant_backend = bnb needs bitsandbytes, which is not importable "
                f"here ({exc}); install it with pip install '{BNB_PIN}', or use "
                f"quant_backend torchao"
            ]
        ) from None


def prequantized(checkpoint_keys) -> bool:
    """Whether a checkpoint holds bitsandbytes 4-bit NF4 weights (saved pre-quantised)."""
    return any(key.endswith(_QUANT_STATE) for key in checkpoint_keys)


def quantize_on_meta(
    linears: list[tuple[str, nn.Linear]], dtype: torch.dtype, device: torch.device
) -> list[str]:
    """Turn each frozen `nn.Linear` (on the meta device, possibly a LoRA base layer) into a
    `Linear4bit` computing in `dtype`, with an empty weight that loading fills. Returns the
    names of their weights."""
    bnb = import_bnb()
    names = []
    for name, module in linears:
        module.__class__ = bnb.nn.Linear4bit
        module.compute_dtype = dtype
        module.compute_type_is_set = True
        module.quant_state = None
        module.quant_storage = torch.uint8
        module.support_avx512bf16_for_cpu = False  # see the module docstring
        module.keel_load_weight = _loader(module, dtype, device)
        module.weight = nn.Parameter(
            torch.empty(0, dtype=torch.uint8, device="meta"), requires_grad=False
        )
        if module.bias is not None:
            module.bias.data = module.bias.data.to(dtype)
        names.append(f"{name}.weight")
    return names


def _loader(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Callable:
    def load(read: Callable[[str], torch.Tensor], key: str, keys) -> None:
        """Install the checkpoint's `key` (read with `read`; `keys`: all its names)."""
        bnb = import_bnb()
        if f"{key}.{_QUANT_STATE}" in keys:
            stats = {k.removeprefix(key + "."): read(k) for k in keys if k.startswith(key + ".")}
            weight = bnb.nn.Params4bit.from_prequantized(
                read(key), stats, requires_grad=False, device=device, module=module
            )
            if weight.quant_state.quant_type != "nf4":
                raise ModelError(
                    f"{key} is stored as bitsandbytes {weight.quant_state.quant_type}; keel "
                    f"trains QLoRA on NF4 only"
                )
            weight.quant_state.dtype = dtype
        else:
            packed, state = bnb.functional.quantize_4bit(
                read(key).to(device=device, dtype=dtype).contiguous(),
                blocksize=64,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=torch.uint8,
            )
            weight = bnb.nn.Params4bit(
                packed,
                requires_grad=False,
                quant_state=state,
                blocksize=64,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=torch.uint8,
                bnb_quantized=True,
                module=module,
            )
        module.weight = weight
        module.quant_state = weight.quant_state

    return load
