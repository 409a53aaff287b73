"""How the processes of a run divide the work, and the one device mesh that says it.

Data parallelism is one mesh axis, "dp", over which DDP replicates and FSDP2 shards:
dp = dp_replicate x dp_shard, where today one of the two is always 1 (DDP: N x 1, FSDP:
1 x N); HSDP (both above 1) is expressible, and its dp axis then unflattens into
"dp_replicate" x "dp_shard". Tensor and context parallelism (tp, cp) are sizes in the
layout so that every reader of the data-parallel degree already asks for `dp_size`, not
the world size; they are refused above 1 until keel implements them.

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

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KeelError(f"parallel degree {name} = {value!r}: it must be an integer >= 1")
        for name in ("tp", "cp"):
            if getattr(self, name) != 1:
                raise KeelError(
                    f"parallel degree {name} = {getattr(self, name)}: keel has no "
                    f"{'tensor' if name == 'tp' else 'context'} parallelism yet; "
                    f"use {name} = 1 (data parallelism over all processes)"
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

    def with_strategy(self, strategy: Strategy) -> ParallelDims:
        """The same processes and mesh, the data-parallel axis split as `strategy` uses it."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            raise KeelError("a replicate x shard (HSDP) layout has no single strategy to switch")
        dp = self.dp_size
        replicate, shard = (1, dp) if strategy.shards else (dp, 1)
        return dataclasses.replace(self, dp_replicate=replicate, dp_shard=shard)

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: how many processes see different rows."""
        return self.dp_replicate * self.dp_shard

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
        """The data-parallel sub-mesh DDP and FSDP2 take: the "dp" axis, or for HSDP its
        ("dp_replicate", "dp_shard") unflattening."""
        assert self.mesh is not None, "no device mesh: one process, or build_mesh not called"
        dp = self.mesh[DP]
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return dp._unflatten(0, (self.dp_replicate, self.dp_shard), (DP_REPLICATE, DP_SHARD))
        return dp
