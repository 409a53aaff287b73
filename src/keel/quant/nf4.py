"""QLoRA's frozen base in NF4 (torchao's `NF4Tensor`), built on the meta device and filled
shard by shard.

The weights become NF4 while the model has no storage, before FSDP2 shards it: torchao's
NF4 tensors split by rows and gather their packed bytes (`fsdp_pre_all_gather`), so each
process allocates only its share of the 4-bit codes, and a full-precision replica never
exists. Each process then quantises only its rows from the checkpoint (`fill_nf4`). The
one number NF4 takes from the whole tensor, the mean of the block absmaxes, is computed
by streaming the tensor's rows, so a shard is quantised exactly as the same rows of the
whole tensor would be: any number of processes holds the same weights (tested).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.quant import import_torchao
from keel.quant.layout import NF4_BLOCK, quantizable, scaler_block

# NormalFloat4's 16 levels (QLoRA, Dettmers et al. 2023), as torchao stores them
_LEVELS = (
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
)
_STREAM_VALUES = 1 << 24  # values read at once while computing a whole tensor's absmax mean


def _nf4_module():
    return import_torchao(
        "quantization.quantize_.workflows.nf4.nf4_tensor", needed_for="method.type = qlora"
    )


def is_nf4(tensor: torch.Tensor) -> bool:
    """An NF4 weight (or a DTensor whose local shard is one); no torchao import needed."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def frozen_linears(layers: nn.ModuleList) -> list[tuple[str, nn.Linear]]:
    """(name under `layers`, module) of every nn.Linear in the decoder layers whose weight
    does not train: LoRA's base layers and the linears LoRA does not target."""
    return [
        (name, module)
        for name, module in layers.named_modules()
        if type(module) is nn.Linear and not module.weight.requires_grad
    ]


def quantize_on_meta(
    layers: nn.ModuleList, dtype: torch.dtype, world: int
) -> tuple[list[str], list[str]]:
    """Replace the frozen linear weights in `layers` (on the meta device) by empty NF4
    weights that dequantise to `dtype`. Returns (quantised, kept): names of the weights
    made NF4 and of those kept in `dtype` because their shape does not fit NF4's blocks
    (or does not split evenly over `world` processes)."""
    quantized, kept = [], []
    for name, module in frozen_linears(layers):
        rows, cols = module.weight.shape
        if not quantizable(rows, cols, world):
            kept.append(f"{name}.weight")
            module.weight.data = module.weight.data.to(dtype)
            continue
        module.weight = nn.Parameter(_empty_nf4(rows, cols, dtype), requires_grad=False)
        quantized.append(f"{name}.weight")
    return quantized, kept


class StoredAs(nn.Module):
    """A parametrization (torch.nn.utils.parametrize) that reads an NF4 [rows, cols]
    parameter as the `shape` tensor it holds, dequantised to its dtype: code that reads
    the attribute (a mixture of experts' fused [experts, out, in] weights) gets plain
    values, and only the NF4 bytes are stored (and sharded by FSDP2, by rows)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.get_original_weight().view(self.shape)


def empty_nf4_as(shape: tuple[int, ...], dtype: torch.dtype, world: int) -> nn.Parameter | None:
    """An empty (meta) NF4 parameter holding a `shape` weight as [prod(shape[:-1]),
    shape[-1]] rows, for `StoredAs`; None when that does not fit NF4's blocks (split over
    `world` processes)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if not quantizable(rows, cols, world):
        return None
    return nn.Parameter(_empty_nf4(rows, cols, dtype), requires_grad=False)


def _empty_nf4(rows: int, cols: int, dtype: torch.dtype):
    nf4 = _nf4_module()
    numel = rows * cols
    blocks = numel // NF4_BLOCK
    size = scaler_block(rows, cols)

    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    header = nf4.SubclassTensorArgs(
        torch.Size((rows, cols)), (cols, 1), 0, dtype, torch.device("meta"), False
    )
    return nf4.NF4Tensor(
        header,
        NF4_BLOCK,
        blocks,
        size,
        meta(blocks, dtype=torch.int8),  # quantised absmaxes
        meta(blocks // size, dtype=dtype),  # their scales
        meta((), dtype=dtype),  # the absmaxes' mean
        meta(numel // 2, dtype=torch.uint8),  # two 4-bit codes per byte
        meta(16, dtype=dtype),  # the levels
    )


def fill_nf4(param: torch.Tensor, rows_value: torch.Tensor, absmax_mean: torch.Tensor) -> None:
    """Quantise `rows_value` (this process's rows of the weight, any float dtype) into the
    allocated NF4 `param` (or the local shard of a DTensor), with the whole tensor's
    `absmax_mean` (`absmax_mean_of`)."""
    target = getattr(param, "_local_tensor", param)  # FSDP2 gathers this very object
    dtype, device = target.dtype, target.quantized_data.device
    value = rows_value.to(device=device, dtype=dtype).contiguous()  # quantised where it lives
    assert tuple(value.shape) == tuple(target.shape), (value.shape, target.shape)
    mean = absmax_mean.to(device=device, dtype=dtype)
    codes, scaler_codes, scaler_scales = _quantize(value, mean, target.scaler_block_size)
    target.quantized_data.copy_(codes)
    target.quantized_scalers.copy_(scaler_codes)
    target.quantization_factor.copy_(scaler_scales)
    # Not among the tensors FSDP2 shards or `to_empty` allocates: set, not copied.
    target.scaler_mean = mean
    target.nf4 = torch.tensor(_LEVELS, dtype=dtype, device=device)


def _quantize(value: torch.Tensor, mean: torch.Tensor, size: int):
    """torchao's NF4 quantisation of `value` with a given absmax mean (torchao computes the
    mean from the tensor it is given, which for a shard is not the whole tensor's)."""
    nf4 = _nf4_module()
    flat = value.flatten()
    blocks = flat.numel() // NF4_BLOCK
    absmax = nf4.get_block_absmax(flat, NF4_BLOCK)
    tiny = torch.finfo(value.dtype).tiny  # an all-zero block (or scaler block) stays finite
    centred = (absmax - mean).view(blocks // size, size)
    scales = 256 / (2 * centred.abs().amax(dim=1).clamp_min(tiny))
    scaler_codes = (centred * scales.unsqueeze(-1)).round().clamp(-128, 127).flatten()
    levels = torch.tensor(_LEVELS, dtype=value.dtype, device=value.device)
    scaled = (flat.view(blocks, NF4_BLOCK) / absmax.clamp_min(tiny).unsqueeze(-1)).flatten()
    # The nearest level, ties to the lower one (torchao's argmin over the 16 distances,
    # found by bisecting the midpoints: ~4x faster, the same codes, tested)
    index = torch.bucketize(scaled, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
    codes = index[::2] << 4 | index[1::2]  # two codes per byte, the first in the high half
    return codes, scaler_codes.to(torch.int8), scales


def absmax_mean_of(read_rows, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Mean over the whole [rows, cols] weight of its 64-value blocks' absmaxes, reading it
    about `_STREAM_VALUES` values at a time with `read_rows(slice)`: every process computes
    the same number without holding the whole tensor."""
    # Whole blocks per read: `unit` rows always hold a multiple of 64 values.
    unit = NF4_BLOCK // math.gcd(cols, NF4_BLOCK)
    step = max(unit, _STREAM_VALUES // cols // unit * unit)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, rows, step):
        part = read_rows(slice(start, min(rows, start + step))).to(dtype).flatten()
        total += part.view(-1, NF4_BLOCK).abs().amax(dim=1).double().sum()
    return (total / (rows * cols // NF4_BLOCK)).to(dtype)
