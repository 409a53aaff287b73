"""The machine: CPU and GPUs (memory, bf16), distributed backends, /dev/shm, environment."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from keel.doctor.report import GIB, Report

SHM_MIN_BYTES = GIB
# The threshold of keel.precision.resolve_precision: bf16 counts as fast from 1.5x.
BF16_FAST_RATIO = 1.5


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_limit(total: int) -> int:
    """The container's memory limit (cgroup v2) when it is below the machine's RAM."""
    with contextlib.suppress(OSError, ValueError):
        limit = int(Path("/sys/fs/cgroup/memory.max").read_text().strip())
        return min(total, limit)
    return total


def cpu_device(report: Report, bf16_speedup: Callable[[], tuple[float, float]]) -> None:
    """The CPU: name, RAM (or the container's limit), and whether bf16 is measurably fast."""
    import psutil

    total = psutil.virtual_memory().total
    memory = _memory_limit(total)
    try:
        fp32, bf16 = bf16_speedup()
    except Exception as exc:  # a CPU (or torch build) that cannot run the probe at all
        fp32 = bf16 = 0.0
        report.problems.append(f"a float32/bfloat16 matmul fails on this CPU: {exc}")
    fast = bf16 >= BF16_FAST_RATIO * fp32
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = {
        "type": "cpu",
        "name": _cpu_name(),
        "memory_bytes": memory,
        "bf16": fast,
        "cores": cores,
        "fp32_gflops": round(fp32, 1),
        "bf16_gflops": round(bf16, 1),
    }
    if memory < total:
        device["host_memory_bytes"] = total
    report.devices.append(device)


def _gpu_device_files() -> bool:
    gpus = Path("/proc/driver/nvidia/gpus")
    return Path("/dev/nvidia0").exists() or (gpus.is_dir() and any(gpus.iterdir()))


def _unusable_gpus(report: Report) -> None:
    """NVIDIA GPUs on the machine that torch cannot see: a job would train on the CPU."""
    import torch

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not _gpu_device_files():
        return
    if hidden is not None and hidden.strip() in ("", "-1"):
        report.notes.append(f"CUDA_VISIBLE_DEVICES={hidden!r} hides this machine's GPUs")
    elif torch.version.cuda is None:
        report.problems.append(
            f"this machine has NVIDIA GPUs, but torch {torch.__version__} is a CPU-only build; "
            "install a CUDA build (https://pytorch.org/get-started/locally/)"
        )
    else:
        report.problems.append(
            f"this machine has NVIDIA GPUs, but torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) cannot use them (torch.cuda.is_available() is False): "
            f"the driver is probably older than CUDA {torch.version.cuda} needs; "
            "check `nvidia-smi` and update the driver or pick a torch build for it"
        )


def _probe_cuda(index: int) -> dict:
    """Name, memory and bf16 of one GPU; a tiny matmul in each dtype must run on it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    with torch.cuda.device(index):
        bf16 = torch.cuda.is_bf16_supported()  # what `precision: auto` asks
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    for dtype in (torch.float32, *([torch.bfloat16] if bf16 else [])):
        a = torch.randn(64, 64, device=f"cuda:{index}", dtype=dtype)
        value = (a @ a).float().sum().item()  # .item() waits for the kernel
        if value != value:  # NaN
            raise RuntimeError(f"a {dtype} matmul returned NaN")
    return {
        "type": "cuda",
        "index": index,
        "name": props.name,
        "memory_bytes": props.total_memory,
        "bf16": bf16,
        "bf16_native": native,
        "compute_capability": f"{props.major}.{props.minor}",
    }


def cuda_devices(report: Report) -> None:
    """Every CUDA device torch sees, each made to run a matmul."""
    import torch

    if not torch.cuda.is_available():
        _unusable_gpus(report)
        return
    for index in range(torch.cuda.device_count()):
        try:
            device = _probe_cuda(index)
        except Exception as exc:
            report.problems.append(
                f"cuda:{index} does not work: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc) else ''}"
            )
            continue
        report.devices.append(device)
        if not device["bf16"]:
            report.notes.append(
                f"cuda:{index} ({device['name']}) has no bf16: "
                "`precision: auto` trains in fp16 with loss scaling"
            )
        elif not device["bf16_native"]:
            report.notes.append(
                f"cuda:{index} ({device['name']}, compute capability "
                f"{device['compute_capability']}) only emulates bf16, which is slow; "
                "`precision: auto` still picks bf16 there: set train.precision=fp16"
            )


def backends(report: Report) -> None:
    """Which torch.distributed backends this build has, and whether keel's group fits them."""
    import torch
    import torch.distributed as dist

    built = dist.is_available()

    def has(name: str) -> bool:
        return built and bool(getattr(dist, f"is_{name}_available", lambda: False)())

    cuda = torch.cuda.is_available()
    report.backends = {
        "distributed": built,
        "gloo": has("gloo"),
        "nccl": has("nccl") and cuda,
        "mpi": has("mpi"),
    }
    if not built:
        report.problems.append(
            f"torch {torch.__version__} was built without torch.distributed:"
            " keel cannot run more than one process; install an official "
            "torch wheel"
        )
    elif not report.backends["gloo"]:
        report.problems.append(
            "torch.distributed has no gloo backend, which keel uses for CPU "
            "tensors and Python objects in every process group"
        )
    if cuda and not report.backends["nccl"]:
        report.problems.append(
            "this torch sees GPUs but has no NCCL backend, which keel uses "
            "for CUDA tensors (cpu:gloo,cuda:nccl)"
        )
    if built:
        _check_keel_backend(report)


def _check_keel_backend(report: Report) -> None:
    """keel's own backend string must give CPU tensors a backend on a GPU (field note 1)."""
    from keel.distributed.process_group import backend_for

    for device_type in ("cpu", "cuda"):
        backend = backend_for(device_type)
        parts = backend.split(",")
        covers_cpu = any(p.startswith("cpu:") or p in ("gloo", "mpi") for p in parts)
        if not covers_cpu:
            report.problems.append(
                f"keel's process group for {device_type} would be {backend!r}, with no CPU "
                "backend: object collectives would fail with 'No backend type associated "
                "with device type cpu'"
            )


def shared_memory(report: Report, gpus: int) -> None:
    """/dev/shm: NCCL's buffers between the GPUs of a node live there (docker gives 64 MiB)."""
    try:
        report.shm_bytes = shutil.disk_usage("/dev/shm").total
    except OSError:
        if sys.platform.startswith("linux"):
            report.notes.append(
                "/dev/shm does not exist: NCCL and torch multiprocessing need it on Linux"
            )
        return
    if report.shm_bytes >= SHM_MIN_BYTES:
        return
    message = (
        f"/dev/shm is only {report.shm_bytes / 2**20:.0f} MiB (docker's default is 64 "
        "MiB): NCCL keeps its buffers between a node's GPUs there and fails with "
        "'unhandled system error' when it runs out; start the container with "
        "--shm-size=8g or --ipc=host"
    )
    (report.problems if gpus >= 2 else report.notes).append(message)


def environment_notes(report: Report) -> None:
    """Environment variables that quietly change how training runs."""
    if os.environ.get("OMP_NUM_THREADS", "").strip() == "1":
        report.notes.append(
            "OMP_NUM_THREADS=1 is set (torchrun's default for its workers): keel sets torch's "
            "threads itself (train.threads, 0 = this process's share of the cores), but "
            "anything else in the process computes on one core; unset it unless you mean it"
        )
