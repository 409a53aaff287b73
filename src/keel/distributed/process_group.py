"""One place that decides the device and sets up (and tears down) the process group.

Every group gets a CPU backend beside the accelerator's (`cpu:gloo,cuda:nccl` on GPUs,
`gloo` on CPU): object collectives and CPU tensors then always have a backend, instead of
failing with "No backend type associated with device type cpu" deep inside a run.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from keel.distributed.parallel_dims import CP, ParallelDims
from keel.errors import KeelError

Log = Callable[[str], None]


def backend_for(device_type: str, accelerator_backend: str = "nccl") -> str:
    """The backend string for `init_process_group`: always a CPU backend, plus the device's."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{accelerator_backend}"


def choose_device(local_rank: int) -> torch.device:
    """cuda:<local_rank> when this node has enough GPUs for its local processes, else CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise KeelError(
                f"local rank {local_rank} has no GPU: this node has {count}; launch at most "
                f"{count} processes per node (--nproc {count})"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass
class DistContext:
    """Who this process is, where it computes, and the collectives the loop needs.

    With world_size 1 no process group exists and every collective is the identity, so the
    training loop has one code path for one and for many processes.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # A gloo group with a long timeout for waits that are not stuck collectives (rank 0
    # tokenizing a large dataset while the others wait).
    slow_group: object | None = None
    # The rendezvous store (keel's prefix): a side channel that works when a backend hangs.
    store: object | None = None
    # That prefix, which the watchdog's own store client shares (see `store_prefix`).
    store_prefix: str = ""
    # Numbers and cross-checks keel's collectives (see CollectiveGuard); None: unchecked.
    guard: CollectiveGuard | None = None
    # How the processes divide the work, with the device mesh built once for the group.
    # Until the strategy is known every process holds a full replica (dp_replicate);
    # model set-up records the strategy's split (`ParallelDims.with_strategy`).
    dims: ParallelDims = field(
        default_factory=lambda: ParallelDims(dp_replicate=1, dp_shard=1, world_size=1)
    )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which share of the rows this process reads (its context-parallel group's)."""
        return self.dims.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """How many processes read different rows: the data-parallel degree."""
        return self.dims.dp_size

    @property
    def grad_size(self) -> int:
        """How many processes DDP and FSDP2 average gradients over (dp x cp)."""
        return self.dims.grad_size

    @property
    def cp_size(self) -> int:
        """How many processes split each micro-batch's tokens (1: none)."""
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        """Which part of its context-parallel group's tokens this process computes."""
        return self.dims.cp_rank(self.rank)

    @property
    def tp_size(self) -> int:
        """How many processes split each decoder layer (1: none)."""
        return self.dims.tp

    @property
    def tp_rank(self) -> int:
        """Which part of its tensor-parallel group's heads and columns this process holds."""
        return self.dims.tp_rank(self.rank)

    @property
    def tp_group(self):
        """The process group of this process's tensor-parallel group (None: tp 1)."""
        return None if self.dims.tp == 1 else self.dims.tp_mesh().get_group()

    @property
    def leads_group(self) -> bool:
        """Whether this process speaks for its context- or tensor-parallel group, whose
        processes hold the same rows (and, under tensor parallelism, the same numbers)."""
        return self.cp_rank == 0 and self.tp_rank == 0

    @property
    def cp_group(self):
        """The process group of this process's context-parallel group (None: cp 1)."""
        return None if self.dims.cp_mesh is None else self.dims.cp_mesh[CP].get_group()

    @property
    def mesh(self):
        """The device mesh over every rank (None: one process)."""
        return self.dims.mesh

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _enter(self, op: str, signature: str, *, slow: bool = False) -> bool:
        """Before each of keel's collectives: False when a test fault skips it."""
        return self.guard is None or self.guard.before(op, signature, slow=slow)

    def barrier(self) -> None:
        if self.distributed and self._enter("barrier", ""):
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few Python numbers over all ranks (in float64 on the CPU backend)."""
        if not self.distributed or not self._enter("all_reduce_sum", f"float64[{len(values)}]"):
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def sum_over_rows(self, values: list[float]) -> list[float]:
        """Sum per-row numbers (loss sums, counts, statistics) over the processes that hold
        different rows' numbers: every process but the tensor-parallel group's first sends
        zeros, since a group's processes compute the same values (one collective over all
        ranks, so the sum is as exact as `all_reduce_sum`'s)."""
        if self.tp_rank:
            values = [0.0] * len(values)
        return self.all_reduce_sum(values)

    def broadcast_object(self, obj, *, src: int = 0, slow: bool = False):
        """Rank `src`'s `obj` on every rank (any picklable object)."""
        if not self.distributed or not self._enter("broadcast_object", f"from {src}", slow=slow):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.slow_group if slow else None)
        return box[0]

    def gather_objects(self, obj, *, slow: bool = False) -> list:
        """Every rank's `obj`, in rank order, on every rank (`slow`: on the slow group)."""
        signature = type(obj).__name__
        if not self.distributed or not self._enter("gather_objects", signature, slow=slow):
            return [obj] * self.world_size
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.slow_group if slow else None)
        return out


def all_reduce_together(tensors: list[torch.Tensor], group) -> None:
    """Sum each of `tensors` (one dtype and device) over `group`, in place, in one
    all-reduce of their concatenation."""
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [numel]
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


class CollectiveGuard:
    """Numbers keel's collectives and checks, through the rendezvous store, that every rank
    makes the same one (op, shapes, dtype, step) before any backend runs it.

    A mismatch (the trl#3068 / trl#1396 kind of bug: ranks gathering different shapes or
    making different calls) is reported at once, where gloo would abort the process and
    NCCL would hang. A rank that never arrives leaves the others waiting here, in the
    store, where the watchdog sees it.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store,
        watchdog,
        fault=None,
        slow_limit_s: float = 86400.0,
    ):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.watchdog, self.fault, self.slow_limit_s = watchdog, fault, slow_limit_s

    def before(self, op: str, signature: str, *, slow: bool = False) -> bool:
        progress = self.watchdog.progress
        if self.fault is not None and self.fault.due("skip_collective", progress.step, self.rank):
            progress.mark(f"skipped {op} (KEEL_FAULT)")
            return False
        record = self.watchdog.collectives.record(op, signature, progress.step)
        progress.mark(("collective", f"#{record.seq}", op))
        mine = [op, signature, record.step]
        self.store.set(f"fp/{record.seq}/{self.rank}", json.dumps(mine))
        keys = [f"fp/{record.seq}/{r}" for r in range(self.world_size)]
        limit = self.slow_limit_s if slow else self._phase_limit()
        # Longer than the watchdog's limit: if a rank never arrives, the watchdog reports it.
        self.store.wait(keys, timedelta(seconds=limit + 60))
        theirs = {r: json.loads(self.store.get(keys[r])) for r in range(self.world_size)}
        differ = {r: v for r, v in theirs.items() if v != mine}
        if differ:
            shown = "; ".join(
                f"rank {r}: {v[0]}({v[1]}) at step {v[2]}" for r, v in sorted(theirs.items())
            )
            self.watchdog.alarm(f"the ranks' collective #{record.seq} differs: {shown}")
        if record.seq >= 2:  # every rank has read #seq-2 before anyone writes #seq
            self.store.delete_key(f"fp/{record.seq - 2}/{self.rank}")
        return True

    def _phase_limit(self) -> float:
        phases = self.watchdog.progress.phases
        limit = phases[-1][1] if phases else None
        return limit if limit is not None else self.slow_limit_s


def watchdog_store(ctx: DistContext, timeout_s: float):
    """A new client of the rendezvous store (MASTER_ADDR:MASTER_PORT) for the watchdog thread,
    so its heartbeats never wait behind the main thread's use of the store."""
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"{ctx.store_prefix}/watchdog", client)


# How many process groups this process has joined: several runs in one process (a sweep in
# one torchrun job) each get keys of their own in the store torchrun keeps for the job.
_groups_joined = itertools.count()


def store_prefix() -> str:
    """keel's prefix in the rendezvous store for the group this process joins next.

    After an elastic restart the workers reuse torchrun's store, which still holds the dead
    attempt's gloo addresses. A second run in the same process would find its first run's
    heartbeats and the collective cross-check's last numbered keys there (both count from 1
    again). Every rank joins its groups in the same order, so the attempt and the group's
    number give all ranks the same fresh prefix."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"keel/{attempt}/{next(_groups_joined)}"


def init_distributed(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    timeout_s: float,
    preprocess_timeout_s: float,
    log: Log = print,
) -> DistContext:
    """Join the process group described by torchrun's (or SLURM-derived) env:// variables.

    The device is decided here, before the first collective, and checked by one: every
    rank reports its host and device so a mixed or oversubscribed job fails at start-up.
    """
    device = choose_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device.type)
    timeout = timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(
            dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout)
        )
        prefix = store_prefix()
        keel_store = dist.PrefixStore(prefix, store)
        dist.init_process_group(
            backend=backend,
            store=keel_store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError, dist.DistStoreError) as exc:
        raise KeelError(explain_startup_error(exc, world_size)) from exc
    slow = dist.new_group(backend="gloo", timeout=timedelta(seconds=preprocess_timeout_s))
    ctx = DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=device,
        slow_group=slow,
        store=keel_store,
        store_prefix=prefix,
        dims=ParallelDims(dp_replicate=world_size, dp_shard=1, world_size=world_size).build_mesh(
            device.type
        ),
    )
    _check_placement(ctx)
    if ctx.is_main:
        log(
            f"process group: {world_size} processes, backend {backend}, device {device.type}, "
            f"collective timeout {timeout_s:.0f}s"
        )
    return ctx


def join_world(world, *, timeout_s: float, preprocess_timeout_s: float, log: Log = print):
    """The process group of `world` (keel.distributed.launch.WorldInfo, started by torchrun
    or srun): an srun task first gets the env:// variables torchrun would have set (node 0's
    address, a port, its rank), then `init_distributed` joins at the world's place."""
    from keel.distributed.launch import slurm_rendezvous_env

    os.environ.update(slurm_rendezvous_env(os.environ))  # {} unless srun started us
    return init_distributed(
        rank=world.rank,
        world_size=world.world_size,
        local_rank=world.local_rank,
        local_world_size=world.local_world_size,
        timeout_s=timeout_s,
        preprocess_timeout_s=preprocess_timeout_s,
        log=log,
    )


def _check_placement(ctx: DistContext) -> None:
    """All ranks on the same device type, and no two ranks of a host on one GPU."""
    mine = (socket.gethostname(), ctx.device.type, ctx.device.index)
    everyone = ctx.gather_objects(mine)
    types = {d for _, d, _ in everyone}
    if len(types) > 1:
        raise KeelError(
            f"ranks disagree on the device type ({sorted(types)}): some nodes see "
            f"a GPU and some do not; run every node on the same kind of machine"
        )
    if "cuda" in types:
        seen: dict[tuple, int] = {}
        for r, (host, _, index) in enumerate(everyone):
            if (host, index) in seen:
                raise KeelError(
                    f"ranks {seen[(host, index)]} and {r} both use cuda:{index} on "
                    f"{host}; use one process per GPU"
                )
            seen[(host, index)] = r


def explain_startup_error(exc: BaseException, world_size: int) -> str:
    """Turn the usual rendezvous failures into what happened and what to do."""
    text = str(exc)
    lowered = text.lower()
    addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if "address already in use" in lowered or "eaddrinuse" in lowered:
        hint = (
            f"the rendezvous port {addr} is already in use (another job, or a previous run "
            f"that did not exit); pick another port in --rdzv-endpoint or stop that process"
        )
    elif "timed out" in lowered or "timeout" in lowered:
        hint = (
            f"not all {world_size} processes joined the rendezvous at {addr} in time; "
            f"check every node runs the same command with the same --nnodes/--nproc and "
            f"can reach {addr}"
        )
    elif "world_size" in lowered or "world size" in lowered or "rank" in lowered:
        hint = (
            f"the processes disagree on the world size ({world_size} expected here); "
            f"launch every node with the same --nnodes and --nproc"
        )
    else:
        hint = "could not set up the process group"
    return f"{hint} (torch.distributed said: {text.splitlines()[0] if text else type(exc)})"


def shutdown(ctx: DistContext) -> None:
    """Destroy every process group. Their gloo threads may live on (see `exit_now`)."""
    if ctx.distributed:
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """End a worker that ran a process group: flush, then exit without interpreter teardown.

    destroy_process_group() frees a group only once nothing else holds it, and FSDP2 and
    DTensor keep their DeviceMesh, and so the gloo group, in caches for the life of the
    process. Its threads then still run while Python and the C++ runtime tear down at exit,
    which under load ended a finished worker with SIGABRT ("terminate called without an
    active exception"). Call this only after everything the process writes is closed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@contextmanager
def main_rank_first(ctx: DistContext):
    """Rank 0 runs the body first; the others wait for it (on the slow group), then run it.

    If rank 0 fails, the others get its error message instead of waiting forever.
    """
    if not ctx.distributed:
        yield
        return
    if ctx.is_main:
        try:
            yield
        except BaseException as exc:
            ctx.broadcast_object(f"{type(exc).__name__}: {exc}", slow=True)
            raise
        ctx.broadcast_object(None, slow=True)
    else:
        failure = ctx.broadcast_object(None, slow=True)
        if failure is not None:
            raise KeelError(f"rank 0 failed while preparing: {failure}")
        yield


def on_main(ctx: DistContext, fn):
    """Run `fn()` on rank 0 only and return its result on every rank.

    A failure on rank 0 is re-raised there and becomes a KeelError with its message on the
    others, so a refused output folder stops every process instead of leaving them waiting.
    """
    if not ctx.distributed:
        return fn()
    if ctx.is_main:
        try:
            result = fn()
        except BaseException as exc:
            ctx.broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
            raise
        ctx.broadcast_object(("ok", result))
        return result
    status, value = ctx.broadcast_object(None)
    if status == "error":
        raise KeelError(f"rank 0 failed: {value}")
    return value
