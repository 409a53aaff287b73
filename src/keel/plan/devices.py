"""What a plan is for: how many devices, of what kind, with how much memory each.

Memory sizes are parsed by `keel.config.sizes.parse_memory`, which config validation
shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from keel.config.sizes import parse_memory

GIB = 2**30

# Of a device's memory, the share a plan may fill. The rest absorbs what no formula here
# sees: allocator fragmentation (PyTorch's caching allocator on a GPU, glibc on a CPU),
# short-lived temporaries, and estimate error.
USABLE_FRACTION = 0.9

# Fixed memory of one training process on a GPU, outside any tensor the plan counts: the
# CUDA context (~0.5 GiB with lazy module loading), NCCL communicator buffers (~0.3 GiB)
# and cuBLAS workspaces. A stated constant, not measured: no GPU was available to measure it.
CUDA_OVERHEAD_BYTES = 1 * GIB
# Host memory of a GPU process besides tensors: the CPU baseline below plus the CUDA
# libraries' host-side pages (~1 GiB). Also a stated constant.
CUDA_HOST_BASELINE_BYTES = 3 * GIB // 2

# Fixed memory of one training process on a CPU: what `keel train` holds besides the
# tensors the plan counts (Python, torch, transformers, peft, datasets/pyarrow, the
# tokenizer, the tokenized data, the allocator's slack). Measured by
# benchmarks/plan_accuracy.py as the peak RSS of a run on a ~20k-parameter model minus that
# model's planned tensors: 484-501 MiB over four runs (Linux x86-64, torch 2.13 CPU,
# transformers 5.23). A bare `import torch, transformers` is 240 MiB of it.
# The plan counts live bytes. With glibc's default (dynamic) mmap threshold, freed tensor
# memory mostly stays with the process and peak RSS runs 7-55% above them; with the
# threshold fixed (mallopt M_MMAP_THRESHOLD) it lands within 3% (same benchmark).
CPU_PROCESS_BYTES = 490 * 2**20


def gib(size: int | float) -> str:
    """`21.6` for 21.6 GiB: how the plan prints sizes."""
    return f"{size / GIB:.1f}"


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """The devices a run will train on: `per_node` devices on each of `nodes` nodes."""

    kind: Literal["cuda", "cpu"]
    per_node: int
    nodes: int = 1
    memory_bytes: int  # of one device (on a CPU: this process's share of the node's RAM)
    # distributed.tensor_parallel: groups of this many devices split each decoder layer
    tensor_parallel: int = 1

    @property
    def world(self) -> int:
        return self.per_node * self.nodes

    @property
    def dp_size(self) -> int:
        """The degree FSDP shards over: every device, or under tensor parallelism one
        device per group (context parallelism splits tokens, and shards over every device
        too: keel.distributed.parallel_dims)."""
        return max(self.world // self.tensor_parallel, 1)

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * USABLE_FRACTION)

    @property
    def overhead_bytes(self) -> int:
        return CUDA_OVERHEAD_BYTES if self.kind == "cuda" else CPU_PROCESS_BYTES

    @property
    def host_baseline_bytes(self) -> int:
        return CUDA_HOST_BASELINE_BYTES if self.kind == "cuda" else CPU_PROCESS_BYTES

    def with_world(self, *, per_node: int | None = None, nodes: int | None = None) -> DeviceSpec:
        """The same kind and memory per device, on a different number of devices."""
        return DeviceSpec(
            kind=self.kind,
            per_node=per_node or self.per_node,
            nodes=nodes or self.nodes,
            memory_bytes=self.memory_bytes,
            tensor_parallel=self.tensor_parallel,
        )

    def describe(self) -> str:
        what = "GPU" if self.kind == "cuda" else "CPU device"
        plural = "s" if self.per_node > 1 else ""
        nodes = f" on each of {self.nodes} nodes" if self.nodes > 1 else ""
        return (
            f"{self.per_node} {what}{plural}{nodes}, {gib(self.memory_bytes)} GiB each "
            f"({gib(self.usable_bytes)} GiB usable: {USABLE_FRACTION:.0%})"
        )


def _override(*sizes: tuple[str, str | int | None]) -> int | None:
    """The first size given (not None or auto) among (flag or key, size) pairs."""
    from keel.errors import ConfigError

    for where, size in sizes:
        if size not in (None, "auto"):
            try:
                return parse_memory(size)
            except ValueError as exc:
                raise ConfigError([f"{where}: {exc}"]) from None
    return None


def detect_devices(
    *,
    gpus: int | None = None,
    nodes: int = 1,
    memory: str | None = None,
    config_memory: str = "auto",
) -> DeviceSpec:
    """Devices to plan for: `gpus` per node if given (CUDA), else this machine's own.

    This machine: its CUDA devices, or else one CPU device with all of the RAM. The memory
    per device is `memory` (e.g. --gpu-memory), else `config_memory`
    (distributed.device_memory) unless "auto", else what is detected here.
    """
    import torch

    from keel.errors import ConfigError

    given = _override(("--gpu-memory", memory), ("distributed.device_memory", config_memory))
    for flag, count in (("--gpus", gpus), ("--nodes", nodes)):
        if count is not None and count < 1:
            raise ConfigError([f"{flag} {count}: give a number of at least 1"])
    have_cuda = torch.cuda.is_available()
    if gpus is not None:
        if given is None and not have_cuda:
            raise ConfigError(
                [
                    f"--gpus {gpus} on a machine without CUDA devices: say how "
                    f"much memory each has with --gpu-memory (e.g. 24GiB)"
                ]
            )
        size = given or _cuda_memory()
        return DeviceSpec(kind="cuda", per_node=gpus, nodes=nodes, memory_bytes=size)
    if have_cuda:
        return DeviceSpec(
            kind="cuda",
            per_node=torch.cuda.device_count(),
            nodes=nodes,
            memory_bytes=given or _cuda_memory(),
        )
    return DeviceSpec(kind="cpu", per_node=1, nodes=nodes, memory_bytes=given or _ram())


def devices_for_run(
    kind: str, *, world_size: int, local_world_size: int, device_memory: str = "auto"
) -> DeviceSpec:
    """The devices of a run being started (for `keel train`): one per process.

    On a CPU each process gets the node's RAM divided by the processes on the node.
    """
    local = max(local_world_size, 1)
    size = _override(("distributed.device_memory", device_memory))
    if size is None:
        size = _cuda_memory() if kind == "cuda" else _ram() // local
    return DeviceSpec(
        kind="cuda" if kind == "cuda" else "cpu",
        per_node=local,
        nodes=max(world_size // local, 1),
        memory_bytes=size,
    )


def _cuda_memory() -> int:
    import torch

    return min(
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    )


def _ram() -> int:
    import psutil

    return psutil.virtual_memory().total
