"""Data parallelism applied from outside the model: DDP, or FSDP2 per unit + root.

Model code never knows it is being sharded (the torchtitan way): `parallelize` takes a
module, the run's `ParallelDims` (whose dp sub-mesh every `apply_*` takes) and settings,
nothing more. The policy model and the frozen reference copy both go through it; they
differ only in their settings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel

from keel.distributed.parallel_dims import DP, ParallelDims
from keel.distributed.process_group import DistContext, all_reduce_together
from keel.distributed.strategy import Strategy
from keel.distributed.tensor_parallel import TensorPlan, apply_tp


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
    # Modules every rank holds whole, outside DDP's reducer and FSDP's units (a vision
    # tower and projector): a rank whose micro-batch has no image never runs them, so any
    # collective of theirs would go out of step. Their trainable parameters' gradients are
    # averaged once per optimizer step by `sync_replicated_grads`.
    replicated: Sequence[nn.Module | nn.Parameter] = ()
    # Tensor parallelism (dims.tp > 1): how `units` split over the "tp" axis, applied
    # before FSDP2 shards them over "dp" (keel.distributed.tensor_parallel)
    tensor: TensorPlan | None = None


def parallelize(model: nn.Module, dims: ParallelDims, settings: ParallelizeSettings) -> nn.Module:
    """`model` replicated (DDP) or sharded (FSDP2) over `dims`' data-parallel sub-mesh, or
    as is (single). FSDP works on the meta device (allocate afterwards: each rank then holds
    only its shards); DDP broadcasts weights, so apply it to the loaded model."""
    if dims.tp > 1:
        assert settings.tensor is not None and settings.strategy.shards, "tp runs under FSDP2"
        apply_tp(settings.units, dims.tp_mesh(), settings.tensor)
    if settings.strategy.shards:
        return apply_fsdp(model, settings.units, dims.dp_mesh(), settings)
    if settings.strategy.replicates:
        ignore = [*settings.ddp_ignore, *_names_of(model, replicated_parameters(settings))]
        return apply_ddp(model, dims.dp_mesh(), ignore=ignore)
    return model


def replicated_parameters(settings: ParallelizeSettings) -> list[nn.Parameter]:
    """The parameters of `settings.replicated`, each once, in module order."""
    seen: dict[int, nn.Parameter] = {}
    for part in settings.replicated:
        for param in [part] if isinstance(part, nn.Parameter) else part.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def _names_of(model: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    """`model`'s qualified names of `params` (DDP's ignore list is by name)."""
    wanted = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in wanted]


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
    # Replicated modules (a vision tower) stay plain tensors on every rank: in the root unit
    # they would be reduce-scattered only by the ranks that ran them.
    ignored = set(replicated_parameters(settings))
    fully_shard(model, **kwargs, ignored_params=ignored or None)
    return model


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 does not wrap, so it is returned as is)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` is an FSDP2 root (`apply_fsdp`'s model)."""
    return isinstance(module, FSDPModule)


@contextmanager
def whole_units(root: nn.Module, mark: Callable[[tuple], None] | None = None) -> Iterator[None]:
    """Every FSDP2 unit of `root` (an `apply_fsdp` model) gathered once, in module order,
    and kept whole through any number of forward passes, so that those make no collective
    (ranks may then run different numbers of them: generation). On exit every unit is
    resharded, which is local, and FSDP's per-iteration bookkeeping (the forward order its
    backward prefetches by) is reset, so the next training forward starts clean.

    Every rank must enter together: the gathers are collectives. `mark((what, i, n))`
    after each unit's gather (the watchdog's progress). Run forward passes inside under
    torch.no_grad, never inference_mode: FSDP keeps the gathered tensors it allocates here
    for the training forwards after, and autograd refuses inference tensors.
    """
    units = [module for module in root.modules() if isinstance(module, FSDPModule)]
    if not units:
        yield
        return
    # The forwards inside run the units without the root: FSDP would make the first of them
    # a root of its own unless the real root is settled first (idempotent).
    root._get_fsdp_state()._lazy_init()
    groups = [group for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups]
    # FSDP's public setter has no getter: keep each group's setting to put it back as it was
    # (the root, unlike the layers, may keep its weights after forward).
    kept = [group.post_forward_mesh_info for group in groups]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for index, unit in enumerate(units):
            unit.unshard()
            if mark is not None:
                mark(("weight gather", index + 1, len(units)))
        yield
    finally:
        for group, setting in zip(groups, kept):
            group.post_forward_mesh_info = setting
        root.reset_iter_state()  # reshards every unit and clears the forward order


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


def sync_replicated_grads(params: Sequence[nn.Parameter], dims: ParallelDims) -> None:
    """Average the gradients of replicated trainable `params` over the processes DDP and
    FSDP2 average every other gradient over (`dims.grad_size`: the data-parallel ones, and
    under context parallelism each group's processes, which hold parts of the same rows):
    one all-reduce per optimizer step, after the window's last backward. A rank whose
    micro-batches never ran them (text only, no image for the vision tower) sends zeros:
    every rank makes the same call. A parameter no rank used keeps no gradient (None), as
    in one process, so the optimizer skips it rather than decaying it and stepping on its
    old moments.
    """
    if dims.mesh is None or dims.grad_size == 1 or not params:
        return
    used = [p.grad is not None for p in params]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    # Divide first, then sum: DDP's order (exact for a power-of-two world).
    grads = [p.grad.div_(dims.grad_size) for p in params]
    users = torch.tensor(used, dtype=grads[0].dtype, device=grads[0].device)  # [P]
    all_reduce_together([*grads, users], dims.mesh[DP].get_group())  # one collective for all
    for param, count in zip(params, users.tolist()):
        if count == 0:
            param.grad = None


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (max_norm 0: the norm only) for gradients on several meshes:
    FSDP2's sharded DTensors beside replicated plain tensors (a trainable vision tower), or
    under tensor parallelism the split layers' (dp, tp) DTensors beside the whole modules'
    dp ones. Each mesh's norm is taken on it and reduced, then they are combined. Returns
    the total norm before clipping, a plain tensor; every rank must call it."""
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for grad in grads:  # in parameter order: every rank groups (and reduces) alike
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    if len(by_mesh) < 2:
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    norms = [full_value(torch.nn.utils.get_total_norm(group)) for group in by_mesh.values()]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))  # []
    if max_norm > 0:  # torch's coefficient, applied to this rank's shards and replicas
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local_tensor(grad).mul_(coefficient.to(grad.dtype))
    return total
