"""gpt-oss checkpoints as they ship: the routed experts in MXFP4, dequantized while keel
loads them (as transformers does with Mxfp4Config(dequantize=True)), so they train in the
model's dtype.

An MXFP4 weight is stored as `<name>_blocks`, [experts, rows, groups, 16] bytes holding two
FP4 (e2m1) values each, low nibble first, and `<name>_scales`, [experts, rows, groups]
bytes, each group of 32 values' power of two plus 127. Row r of the stored layout is output
feature r; the model holds the weight transposed, [experts, in, out]. Every FP4 value times
a power of two is exact in bf16 and fp32, so the dequantized weight is the checkpoint's
exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

# e2m1: the 16 values a nibble holds (sign bit high)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_BIAS = 127


@dataclass(frozen=True)
class Mxfp4Experts:
    """A fused expert weight the checkpoint stores in MXFP4 (`blocks` and `scales` keys)."""

    blocks: str
    scales: str

    def shape(self, shape_of: Callable[[str], tuple[int, ...] | None]) -> tuple[int, ...] | None:
        """[experts, in, out]; None when the two tensors do not make one weight."""
        blocks, scales = shape_of(self.blocks), shape_of(self.scales)
        if not blocks or not scales or len(blocks) != 4 or tuple(blocks[:3]) != tuple(scales):
            return None
        experts, rows, groups, width = blocks
        return experts, groups * width * 2, rows

    def read(self, reader, region: tuple[slice, ...] | None) -> torch.Tensor:
        """The dequantized weight (fp32), or `region` of it, from `reader` (a
        CheckpointReader): only the experts in its first slice are read, and dequantized
        one at a time (bounded transients)."""
        shape = self.shape(reader.shape)
        experts = range(shape[0])
        if region is not None:
            experts = experts[region[0]]
        out = torch.empty((len(experts), *shape[1:]), dtype=torch.float32)
        values = torch.tensor(FP4_VALUES, dtype=torch.float32)
        for i, expert in enumerate(experts):
            rows = (slice(expert, expert + 1),)
            blocks, scales = reader.get(self.blocks, rows)[0], reader.get(self.scales, rows)[0]
            low, high = values[(blocks & 0x0F).int()], values[(blocks >> 4).int()]
            pairs = torch.stack((low, high), dim=-1).flatten(-2)  # [rows, groups, 32]
            exponents = scales.to(torch.int32) - SCALE_BIAS
            out[i] = torch.ldexp(pairs, exponents.unsqueeze(-1)).flatten(-2).T
        return out if region is None else out[(slice(None), *region[1:])]


def mxfp4_weights(names: Iterable[str], keys: Iterable[str]) -> dict[str, Mxfp4Experts]:
    """The model tensors (by name) the checkpoint stores as MXFP4 blocks and scales."""
    stored = set(keys)
    return {
        name: Mxfp4Experts(name + BLOCKS, name + SCALES)
        for name in names
        if name not in stored and name + BLOCKS in stored and name + SCALES in stored
    }


def is_mxfp4(config) -> bool:
    """Whether a model config says its checkpoint holds MXFP4 weights (gpt-oss)."""
    quantization = getattr(config, "quantization_config", None)
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    return str(method).lower().endswith("mxfp4")
