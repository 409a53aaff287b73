"""Data parallelism applied from outside the model: DDP, or FSDP2 per unit + root.

Model code never knows it is being sharded (the torchtitan way): `parallelize` takes a
module, the run's `ParallelDims` (whose dp sub-mesh every `apply_*` takes) and settings,
nothing more. The policy model and the frozen reference copy both go through it; they
differ only in their settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel

from keel.distributed.parallel_dims import ParallelDims
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy


@dataclass(frozen=True, kw_only=True)
class ParallelizeSettings:
    """How `parallelize` lays one module over the data-parallel processes."""

    strategy: Strategy
    # FSDP: the modules inside the root that are their own units, in order (`fsdp_units`)
    units: Sequence[nn.Module] = ()
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # FSDP: shards in host memory (only meaningful on a GPU)
    param_dtype: torch.dtype | None = None  # FSDP mixed precision: compute dtype
    reduce_dtype: torch.dtype | None = None  # FSDP mixed precision: gradient reduction dtype
    # DDP: parameters not broadcast from rank 0 (see `apply_ddp`)
    ddp_ignore: Sequence[str] = ()


def parallelize(model: nn.Module, dims: ParallelDims, settings: ParallelizeSettings) -> nn.Module:
    """`model` replicated (DDP) or sharded (FSDP2) over `dims`' data-parallel sub-mesh, or
    as is (single). FSDP works on the meta device (allocate afterwards: each rank then holds
    only its shards); DDP broadcasts weights, so apply it to the loaded model."""
    if settings.strategy.shards:
        return apply_fsdp(model, settings.units, dims.dp_mesh(), settings)
    if settings.strategy.replicates:
        return apply_ddp(model, dims.dp_mesh(), ignore=settings.ddp_ignore)
    return model


def fsdp_units(lm: nn.Module, layers: Iterable[nn.Module], *, embeddings: bool) -> list[nn.Module]:
    """The FSDP units of causal LM `lm`: each of its decoder `layers`, and with `embeddings`
    its input embeddings too when they are untied.

    Untied input embeddings as their own unit keep the root (output layer + final norm)
    from being gathered together with a second vocabulary-sized matrix. Tied ones must stay
    in the root with the output layer that shares them.
    """
    units = list(layers)
    if embeddings:
        inputs = lm.get_input_embeddings()
        if inputs.weight is not lm.get_output_embeddings().weight:
            units.insert(0, inputs)
    return units


def apply_ddp(module: nn.Module, mesh: DeviceMesh, ignore: Sequence[str] = ()) -> nn.Module:
    """Wrap `module` in DDP over `mesh` (1-D, data-parallel). Its parameters are broadcast
    from the mesh's first rank at construction, except those named in `ignore` (frozen
    weights every rank loaded identically, in a layout the broadcast cannot send, e.g.
    QLoRA's NF4 base)."""
    device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    # Frozen parameters (LoRA, freeze) never get gradients; DDP skips them on its own since
    # it only registers hooks for parameters that require grad. Gradients as views into the
    # all-reduce buckets: otherwise DDP holds a second full copy of them (measured +1.5 GB
    # per rank on a 0.4B model).
    return DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=mesh.get_group(),
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )


def apply_fsdp(
    model: nn.Module, units: Iterable[nn.Module], mesh: DeviceMesh, settings: ParallelizeSettings
) -> nn.Module:
    """Shard each of `units` as its own FSDP2 unit over `mesh` (1-D: FSDP; 2-D replicate x
    shard: HSDP), then `model` as the root unit.

    Works on a model still on the meta device: call `model.to_empty(device=...)` afterwards
    and every rank allocates only its own shards.
    """
    policy = MixedPrecisionPolicy(
        param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype
    )
    kwargs = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward)
    if settings.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in units:
        fully_shard(unit, **kwargs)
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


def device_memory_bytes(ctx: DistContext) -> int:
    """Memory one process may use: the GPU's, or this node's RAM shared by its processes."""
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_properties(ctx.device).total_memory
    import psutil

    return psutil.virtual_memory().total // max(ctx.local_world_size, 1)
