"""The resolved compute precision: one type from the config boundary down, and why it was chosen.

`train.precision` (auto | fp32 | bf16 | fp16) is the user's string; it is resolved once
(`resolve_precision`, or the planner's stand-in where no device is measured) into a
`Precision`, which every package below the config takes: the planner (plan/), QLoRA's
compute dtype (models/), the resume identity (checkpoint/) and the loop (train/). It lives
at the top of the package, beside keel.errors, because all of those import it and none may
import another's package for it (plan and models must not import train). What is written
to disk (checkpoint meta, reference-cache keys, keel_run.json) is `Precision.name`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from keel.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision's values once auto is resolved


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16
    reason: str  # why: "set by train.precision", or what auto measured

    def __post_init__(self) -> None:
        assert self.name in PRECISIONS, f"unresolved precision {self.name!r}"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The matmul dtype under autocast; None in fp32 (no autocast)."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in: the autocast dtype, else fp32."""
        return self.autocast_dtype or torch.float32

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element of a matmul's output: 2 under bf16/fp16, 4 in fp32."""
        return 4 if self.name == "fp32" else 2

    def autocast(self, device: torch.device):
        """Mixed-precision context: master weights stay as loaded, matmuls run in low precision."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


def _matmul_gflops(dtype: torch.dtype, size: int = 512, repeats: int = 3) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: first call pays for kernel selection
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def cpu_bf16_speedup(rounds: int = 3) -> tuple[float, float]:
    """Measured (fp32, bf16) matmul GFLOP/s on this CPU: flags lie, a short probe does not.

    The best of `rounds` interleaved measurements of each: another process on a shared
    machine only ever slows a measurement down, and interleaving gives both the same
    chances (one measurement each flipped the verdict under load).
    """
    fp32, bf16 = 0.0, 0.0
    for _ in range(rounds):
        fp32 = max(fp32, _matmul_gflops(torch.float32))
        bf16 = max(bf16, _matmul_gflops(torch.bfloat16))
    return fp32, bf16


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """Map train.precision (auto|fp32|bf16|fp16) to a concrete choice for `device`.

    auto: on CUDA, bf16 where supported else fp16. On a CPU, bf16 only when a measured bf16
    matmul is at least 1.5x faster than fp32 (AMX / AVX512-BF16); without those units bf16
    runs ~20x *slower* than fp32 (measured on an AVX2 machine), so fp32 is chosen.
    """
    if requested != "auto":
        if requested == "fp16" and device.type == "cpu":
            raise ConfigError(
                ["train.precision = fp16 is not supported on a CPU; use bf16, fp32 or auto"]
            )
        return Precision(requested, "set by train.precision")
    if device.type == "cuda":
        # Emulated bf16 (V100, T4) runs far slower than fp16 there: only native counts.
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", "auto: this GPU supports bf16")
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        return Precision(
            "fp16",
            f"auto: {name} (compute capability {major}.{minor}) has no native bf16 (8.0+); "
            f"fp16 with dynamic loss scaling",
        )
    fp32, bf16 = cpu_bf16_speedup()
    figures = f"bf16 matmul {bf16:.0f} GFLOP/s vs fp32 {fp32:.0f} GFLOP/s on this CPU"
    if bf16 >= 1.5 * fp32:
        return Precision("bf16", f"auto: {figures} (hardware bf16)")
    return Precision("fp32", f"auto: {figures}; no fast bf16 here, fp32 is faster")
