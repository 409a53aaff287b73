"""Data parallelism applied from outside the model: DDP, or FSDP2 per decoder layer + root.

Model code never knows it is being sharded (the torchtitan way): these functions take a
module and the layers to shard, nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel

from keel.distributed.process_group import DistContext


def apply_ddp(module: nn.Module, ctx: DistContext, ignore: list[str] = ()) -> nn.Module:
    """Wrap `module` in DDP. Its parameters are broadcast from rank 0 at construction,
    except those named in `ignore` (frozen weights every rank loaded identically, in a
    layout the broadcast cannot send, e.g. QLoRA's NF4 base)."""
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    # Frozen parameters (LoRA, freeze) never get gradients; DDP skips them on its own since
    # it only registers hooks for parameters that require grad. Gradients as views into the
    # all-reduce buckets: otherwise DDP holds a second full copy of them (measured +1.5 GB
    # per rank on a 0.4B model).
    return DistributedDataParallel(
        module, device_ids=device_ids, broadcast_buffers=False, gradient_as_bucket_view=True
    )


def apply_fsdp(
    model: nn.Module,
    layers: Iterable[nn.Module],
    ctx: DistContext,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> nn.Module:
    """Shard each of `layers` as its own FSDP2 unit, then `model` as the root unit.

    Works on a model still on the meta device: call `model.to_empty(device=...)` afterwards
    and every rank allocates only its own shards.
    """
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else None
    kwargs = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if offload is not None:
        kwargs["offload_policy"] = offload
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 does not wrap, so it is returned as is)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def gradient_sync(module: nn.Module, enabled: bool):
    """Context for one micro-batch's backward: skip the gradient all-reduce when not `enabled`.

    Only DDP skips; FSDP2 reduce-scatters every micro-batch so unsharded gradients never
    accumulate (memory over communication).
    """
    if not enabled and isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return nullcontext()


def local_region(param: torch.Tensor) -> tuple[slice, ...] | None:
    """Which part of the full tensor this rank holds for `param` (None: all of it).

    Lets a loader read just those rows from disk, so a rank never touches the rest.
    """
    if not isinstance(param, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (a collective: every rank must call it), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def choose_strategy(
    requested: str, world_size: int, replica_bytes: int, device_bytes: int
) -> tuple[str, str]:
    """("none" | "ddp" | "fsdp", why). auto: fsdp only when a full replica would not fit.

    `replica_bytes` is weights + gradients + optimizer state of one full copy; 80% of the
    device is the budget, the rest is left for activations (the memory planner refines this).
    """
    if world_size == 1:
        return "none", "one process: no data-parallel wrapper"
    if requested != "auto":
        return requested, "set by distributed.strategy"
    gib = 2**30
    figures = (
        f"a full replica needs ~{replica_bytes / gib:.2f} GiB of "
        f"{device_bytes / gib:.2f} GiB per device"
    )
    if replica_bytes > 0.8 * device_bytes:
        return "fsdp", f"auto: {figures}, more than 80%: shard it"
    return "ddp", f"auto: {figures}: it fits, replicate"


def device_memory_bytes(ctx: DistContext) -> int:
    """Memory one process may use: the GPU's, or this node's RAM shared by its processes."""
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_properties(ctx.device).total_memory
    import psutil

    return psutil.virtual_memory().total // max(ctx.local_world_size, 1)
