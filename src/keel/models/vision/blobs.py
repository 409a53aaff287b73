"""One image's tensors <-> bytes, for the data cache (safetensors: never pickle)."""

from __future__ import annotations

import torch
from safetensors.torch import load, save


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of `tensors` (contiguous CPU copies; names kept)."""
    return save({name: t.detach().cpu().contiguous() for name, t in tensors.items()})


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors `pack` stored, in their stored dtypes, on the CPU."""
    return load(bytes(blob))
