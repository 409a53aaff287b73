"""How the processes of a run divide the work, and the one device mesh that says it.

Data parallelism is one mesh axis, "dp", over which DDP replicates and FSDP2 shards:
dp = dp_replicate x dp_shard (DDP: N x 1, FSDP: 1 x N, HSDP with
distributed.fsdp.shard_size S: N/S x S, its dp axis unflattened into "dp_replicate" x
"dp_shard": each group of S consecutive processes holds one sharded copy).

Context parallelism (distributed.context_parallel C) splits each micro-batch's tokens over
groups of C consecutive processes (keel.distributed.context_parallel): a group reads the
same rows, so the data-parallel degree is world / C, while gradients are still averaged
(DDP) or sharded (FSDP2) over every process, as the group's processes hold the same
weights. Its "cp" groups come from a (dp, cp) mesh built beside the world's.

Tensor parallelism (distributed.tensor_parallel T) splits each decoder layer's attention
heads and MLP columns over groups of T consecutive processes (keel.distributed.
tensor_parallel): a group reads the same rows and holds 1/T of those layers, so the
data-parallel degree is world / T. The world's mesh is then one 2-D (dp, tp) mesh: FSDP2
shards over its "dp" axis the tensors that the "tp" axis splits (FSDP2 + TP needs both on
one root mesh), and HSDP unflattens that "dp" axis as it does without tp (a (dp_replicate,
dp_shard, tp) layout). Gradients are averaged over dp only: a tp group's processes compute
the same tokens.

The mesh is built once per process group (`build_mesh`) and handed to every `apply_*`
through `dp_mesh`. Over all ranks a one-axis mesh uses the default process group, so it
adds no communicator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from keel.distributed.strategy import Strategy
from keel.errors import KeelError

DP = "dp"
CP = "cp"
TP = "tp"
DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The parallel degrees of a run; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    cp: int = 1
    world_size: int
    # the mesh over the world's ranks (None: one process, no process group)
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    # the context-parallel groups' mesh (cp > 1: its "cp" axis; see `with_context`)
    cp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KeelError(f"parallel degree {name} = {value!r}: it must be an integer >= 1")
        if self.tp > 1 and self.cp > 1:
            raise KeelError(
                f"tensor parallelism ({self.tp}) with context parallelism ({self.cp}): keel "
                f"splits a layer's heads or a row's tokens, not both; set one of "
                f"distributed.tensor_parallel and distributed.context_parallel to 1"
            )
        if self.cp > 1 and self.hybrid:
            raise KeelError(
                f"context parallelism ({self.cp}) with HSDP (distributed.fsdp.shard_size): "
                f"keel shards over every process under context parallelism; set "
                f"distributed.fsdp.shard_size 0"
            )
        product = self.dp_replicate * self.dp_shard * self.tp * self.cp
        if product != self.world_size:
            raise KeelError(
                f"parallel degrees dp_replicate ({self.dp_replicate}) x dp_shard "
                f"({self.dp_shard}) x tp ({self.tp}) x cp ({self.cp}) = {product}, but "
                f"the world has {self.world_size} processes; they must multiply to it"
            )

    @classmethod
    def for_strategy(cls, strategy: Strategy, world_size: int) -> ParallelDims:
        """Data parallelism over the whole world: sharded (fsdp) or replicated (ddp, single)."""
        replicated = cls(dp_replicate=world_size, dp_shard=1, world_size=world_size)
        return replicated.with_strategy(strategy)

    def with_strategy(self, strategy: Strategy, shard_size: int | None = None) -> ParallelDims:
        """The same processes and mesh, the data-parallel axis split as `strategy` uses it.
        A sharding strategy shards over groups of `shard_size` processes and replicates
        across the groups (HSDP) when `shard_size` is below the data-parallel degree; 0
        shards over all, None keeps the current groups (a frozen copy sharded as the model)."""
        dp = self.dp_size
        if not strategy.shards:
            return dataclasses.replace(self, dp_replicate=dp, dp_shard=1)
        if shard_size is None:
            shard_size = self.dp_shard if self.hybrid else 0
        if self.cp > 1 and shard_size:
            raise KeelError(
                f"distributed.fsdp.shard_size = {shard_size} with distributed."
                f"context_parallel = {self.cp}: keel shards over every process under context "
                f"parallelism; set shard_size 0"
            )
        shard = shard_size or dp
        if shard > dp or dp % shard or (shard == 1 and dp > 1):
            raise KeelError(
                f"distributed.fsdp.shard_size = {shard_size}: the {dp} data-parallel processes "
                f"do not split into groups of {shard_size}; use a divisor of {dp} (e.g. the "
                f"processes of one node), or 0 to shard over all"
            )
        return dataclasses.replace(self, dp_replicate=dp // shard, dp_shard=shard)

    @property
    def hybrid(self) -> bool:
        """Sharded within groups and replicated across them (HSDP)."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: how many processes see different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_size(self) -> int:
        """How many processes DDP and FSDP2 average gradients over: the data-parallel
        degree times the context-parallel one (a cp group's processes each hold part of
        its rows' tokens, and the same weights)."""
        return self.dp_size * self.cp

    def cp_rank(self, rank: int) -> int:
        """Which part of its group's tokens global rank `rank` computes (0 without cp)."""
        return rank % self.cp

    def with_context(self, cp: int, device_type: str) -> ParallelDims:
        """These processes in groups of `cp` consecutive ones that split each micro-batch's
        tokens, with the groups' mesh (every rank must call it; cp 1: unchanged)."""
        if cp == self.cp:
            return self
        groups = data_parallel_size(self.world_size, cp)
        dims = dataclasses.replace(self, dp_replicate=groups, dp_shard=1, cp=cp)
        shape, names = (groups, cp), (DP, CP)  # a root mesh of its own
        return dataclasses.replace(
            dims, cp_mesh=init_device_mesh(device_type, shape, mesh_dim_names=names)
        )

    def tp_rank(self, rank: int) -> int:
        """Which part of its group's heads and columns global rank `rank` holds (0 without tp)."""
        return rank % self.tp

    def with_tensor(self, tp: int, device_type: str) -> ParallelDims:
        """These processes in groups of `tp` consecutive ones that split each decoder layer,
        with the world's mesh rebuilt as (dp, tp) (every rank must call it; tp 1: unchanged)."""
        if tp == self.tp:
            return self
        groups = data_parallel_size(self.world_size, self.cp, tp)
        dims = dataclasses.replace(self, dp_replicate=groups, dp_shard=1, tp=tp)
        if self.mesh is None:
            return dims
        shape, names = (groups, tp), (DP, TP)
        return dataclasses.replace(
            dims, mesh=init_device_mesh(device_type, shape, mesh_dim_names=names)
        )

    def tp_mesh(self) -> DeviceMesh:
        """The "tp" axis of the world's (dp, tp) mesh: the groups that split each layer."""
        assert self.mesh is not None and self.tp > 1, "no tensor-parallel mesh"
        return self.mesh[TP]

    def dp_rank(self, rank: int) -> int:
        """Which share of the rows global rank `rank` reads. tp and cp ranks, when they
        exist, are the fastest-moving: they see the same rows as their dp neighbours."""
        return rank // (self.tp * self.cp)

    def build_mesh(self, device_type: str) -> ParallelDims:
        """These dims with their device mesh: one named "dp" axis (the process group must
        exist). Build it once per run; every sub-mesh comes from it."""
        mesh = init_device_mesh(device_type, (self.dp_size,), mesh_dim_names=(DP,))
        return dataclasses.replace(self, mesh=mesh)

    def dp_mesh(self) -> DeviceMesh:
        """The sub-mesh DDP and FSDP2 take: the "dp" axis over every process (which under
        context parallelism spans its groups too: see `grad_size`), or for HSDP its
        ("dp_replicate", "dp_shard") unflattening."""
        assert self.mesh is not None, "no device mesh: one process, or build_mesh not called"
        dp = self.mesh[DP]
        if self.hybrid:
            return dp._unflatten(0, (self.dp_replicate, self.dp_shard), (DP_REPLICATE, DP_SHARD))
        return dp


def data_parallel_size(world_size: int, cp: int, tp: int = 1) -> int:
    """How many processes read different rows when groups of `cp` split each micro-batch's
    tokens or groups of `tp` split each layer (known from the config before the groups are
    made); refused unless the group size divides the processes."""
    for size, key in ((cp, "context_parallel"), (tp, "tensor_parallel")):
        if world_size % size:
            raise KeelError(
                f"distributed.{key} = {size} does not divide the {world_size} processes; "
                f"use a divisor of {world_size}"
            )
    return world_size // (cp * tp)
