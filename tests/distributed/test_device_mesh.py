"""The device mesh over 2 gloo processes: built once by init_distributed, and its dp
sub-mesh is what DDP and FSDP2 run on (gradients averaged over it, one step each)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiproc import free_port
from torch import nn

from keel.distributed.parallelize import ParallelizeSettings, full_value, parallelize
from keel.distributed.process_group import exit_now, init_distributed, shutdown
from keel.distributed.strategy import Strategy


def _one_step(model: nn.Module, rank: int) -> list[float]:
    """Rank r's loss is the output's sum times r + 1: averaged gradients are the mean's."""
    (model(torch.ones(2, 4)).sum() * (rank + 1)).backward()
    return [full_value(p.grad).sum().item() for p in model.parameters()]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(
        rank=rank,
        world_size=world,
        local_rank=rank,
        local_world_size=world,
        timeout_s=60,
        preprocess_timeout_s=60,
        log=lambda _m: None,
    )
    seen = {
        "names": list(ctx.mesh.mesh_dim_names),
        "dp": [ctx.dp_rank, ctx.dp_size],
        "world_group": ctx.mesh.get_group() is dist.group.WORLD,
    }
    for strategy in (Strategy.DDP, Strategy.FSDP):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        dims = ctx.dims.with_strategy(strategy)
        settings = ParallelizeSettings(strategy=strategy, units=[model[0]])
        wrapped = parallelize(model, dims, settings)
        if strategy.replicates:
            seen["ddp_group"] = wrapped.process_group is dims.dp_mesh().get_group()
        else:
            seen["fsdp_mesh"] = all(p.device_mesh is ctx.mesh for p in model.parameters())
        seen[strategy.value] = _one_step(wrapped, rank)
    torch.manual_seed(0)
    alone = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    (alone(torch.ones(2, 4)).sum() * 1.5).backward()  # the mean of (r + 1) over 2 ranks
    seen["alone"] = [p.grad.sum().item() for p in alone.parameters()]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    shutdown(ctx)
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here


def test_ddp_and_fsdp_run_on_the_mesh_built_at_start(tmp_path):
    out = str(tmp_path / "seen")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen["names"] == ["dp"] and seen["dp"] == [rank, 2] and seen["world_group"]
        assert seen["ddp_group"] and seen["fsdp_mesh"]
        for strategy in ("ddp", "fsdp"):
            assert seen[strategy] == pytest.approx(seen["alone"], rel=1e-6), strategy
