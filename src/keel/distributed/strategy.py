"""The one vocabulary for how a run lays its model over processes, and the one decider
from the config to it.

The YAML keeps its own words (`distributed.strategy: auto|ddp|fsdp` and
`distributed.fsdp.cpu_offload`); the planner, the trainer and the model set-up speak only
`Strategy`. No torch import: the planner reads this without loading torch.distributed.
"""

from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    """single: one process, no wrapper. ddp: a full replica per process, gradients
    all-reduced. fsdp: parameters, gradients and optimizer state sharded (FSDP2).
    fsdp_offload: fsdp with the shards in host memory (GPUs only)."""

    SINGLE = "single"
    DDP = "ddp"
    FSDP = "fsdp"
    FSDP_OFFLOAD = "fsdp_offload"

    @property
    def shards(self) -> bool:
        """Parameters are sharded over the data-parallel processes (FSDP2)."""
        return self in (Strategy.FSDP, Strategy.FSDP_OFFLOAD)

    @property
    def replicates(self) -> bool:
        """Every process holds a full copy inside a DDP wrapper."""
        return self is Strategy.DDP

    @property
    def config_value(self) -> str:
        """What distributed.strategy says for this strategy (fsdp_offload: fsdp, with
        distributed.fsdp.cpu_offload = true)."""
        return self.value.removesuffix("_offload")


# cheapest first: the order auto tries them in and the plan lists them in
STRATEGIES = tuple(Strategy)


def configured_strategy(
    requested: str, *, cpu_offload: bool, dp_size: int, cuda: bool, tensor_parallel: int = 1
) -> Strategy | None:
    """The strategy distributed.strategy (auto | ddp | fsdp) and distributed.fsdp.cpu_offload
    ask for over `dp_size` data-parallel processes; None: auto decides from memory. Tensor
    parallelism runs under FSDP2 whatever the data-parallel degree.

    Offload needs a GPU to offload from: on a CPU, fsdp with cpu_offload is plain fsdp.
    """
    if tensor_parallel > 1:
        requested = "fsdp"
    elif dp_size == 1:
        return Strategy.SINGLE
    if requested == "auto":
        return None
    if requested == "fsdp" and cpu_offload and cuda:
        return Strategy.FSDP_OFFLOAD
    return Strategy(requested)


def choose_strategy(
    requested: Strategy | None, dp_size: int, replica_bytes: int, device_bytes: int
) -> tuple[Strategy, str]:
    """(strategy, why) when no memory plan could be made: `requested` (from
    `configured_strategy`) if set, else fsdp only when a full replica would not fit.

    `replica_bytes` is weights + gradients + optimizer state of one full copy; 80% of the
    device is the budget, the rest is left for activations (the memory planner refines this).
    """
    if dp_size == 1:
        return Strategy.SINGLE, "one process: no data-parallel wrapper"
    if requested is not None:
        return requested, "set by distributed.strategy"
    gib = 2**30
    figures = (
        f"a full replica needs ~{replica_bytes / gib:.2f} GiB of "
        f"{device_bytes / gib:.2f} GiB per device"
    )
    if replica_bytes > 0.8 * device_bytes:
        return Strategy.FSDP, f"auto: {figures}, more than 80%: shard it"
    return Strategy.DDP, f"auto: {figures}: it fits, replicate"
