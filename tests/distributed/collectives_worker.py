"""Run under torchrun by test_collectives.py: object collectives in every strategy.

Writes what each rank saw to <out>/rank-<r>.json; the test asserts on those files.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from keel.distributed.launch import detect_world
from keel.distributed.parallelize import ParallelizeSettings, parallelize
from keel.distributed.process_group import (
    backend_for,
    exit_now,
    init_distributed,
    main_rank_first,
    on_main,
    shutdown,
)
from keel.distributed.strategy import Strategy
from keel.errors import KeelError
from keel.train.same_data import check_same_data


def wrapped(strategy: Strategy, ctx) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    settings = ParallelizeSettings(strategy=strategy, units=[model[0]])
    return parallelize(model, ctx.dims.with_strategy(strategy), settings)


def main(out: Path) -> None:
    world = detect_world(__import__("os").environ)
    ctx = init_distributed(
        rank=world.rank,
        world_size=world.world_size,
        local_rank=world.local_rank,
        local_world_size=world.local_world_size,
        timeout_s=60,
        preprocess_timeout_s=60,
        log=lambda _m: None,
    )
    seen: dict = {"launcher": world.launcher}
    for strategy in (Strategy.SINGLE, Strategy.DDP, Strategy.FSDP):
        model = wrapped(strategy, ctx)
        model(torch.ones(2, 4)).sum().backward()
        seen[strategy] = {
            "broadcast": ctx.broadcast_object({"from": ctx.rank, "strategy": strategy}),
            "gathered": ctx.gather_objects(ctx.rank * 10),
            "summed": ctx.all_reduce_sum([ctx.rank + 1.0]),
        }
    # An accelerator-only backend string leaves CPU tensors without a backend (field
    # note 5) ...
    try:
        dist.all_reduce(torch.ones(1), group=dist.new_group(backend="cuda:gloo"))
        seen["accelerator_only"] = "worked"
    except RuntimeError as exc:
        seen["accelerator_only"] = str(exc)
    # ... keel's backend string always registers one.
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=dist.new_group(backend=backend_for("cuda", "gloo")))
    seen["keel_backend"] = tensor.item()
    # A failure on rank 0 while the others wait reaches them as an error, not a hang.
    try:
        with main_rank_first(ctx):
            if ctx.is_main:
                raise ValueError("bad dataset row 7")
        seen["rank0_failure"] = "no error"
    except (ValueError, KeelError) as exc:
        seen["rank0_failure"] = str(exc)
    try:
        on_main(ctx, lambda: (_ for _ in ()).throw(KeelError("output.dir is not empty")))
    except KeelError as exc:
        seen["on_main_failure"] = str(exc)
    # The same data everywhere passes; rank 1 with other rows stops every rank, named.
    check_same_data("a" * 64, ctx)
    try:
        check_same_data("a" * 64 if ctx.is_main else "b" * 64, ctx)
        seen["other_data"] = "no error"
    except KeelError as exc:
        seen["other_data"] = str(exc)
    (out / f"rank-{ctx.rank}.json").write_text(json.dumps(seen))
    shutdown(ctx)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here
