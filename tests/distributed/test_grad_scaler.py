"""fp16 loss scaling over 2 gloo processes: every rank skips the same steps.

Rank 1 alone sees an inf gradient. Under FSDP (`grad_scaler(..., Strategy.FSDP)`) both ranks skip
the step and halve the scale. The negative control: a plain GradScaler over gradients that
are not DTensors lets rank 0 step while rank 1 skips — the disagreement the sharded scaler
prevents. (FSDP2's DTensor gradients also agree with a plain GradScaler in torch 2.13: its
DTensor handler for the overflow check reduces it over the mesh; checked here too.)
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from keel.distributed.process_group import exit_now
from keel.distributed.strategy import Strategy
from keel.precision import Precision
from keel.train.loop import grad_scaler

FP16 = Precision("fp16", "test")


def _step(model: nn.Module, strategy: Strategy, rank: int, grad) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = grad_scaler(torch.device("cpu"), FP16, strategy)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if rank == 1:
        grad(model).fill_(float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    return {"stepped": stepped, "scale": scaler.get_scale(), "class": type(scaler).__name__}


def _worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    seen = {}
    for strategy in (Strategy.SINGLE, Strategy.FSDP):
        torch.manual_seed(0)
        sharded = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world,)))
        seen[f"fsdp2-{strategy}"] = _step(
            sharded, strategy, rank, lambda m: m.weight.grad._local_tensor
        )
        torch.manual_seed(0)
        local = nn.Linear(4, 4)  # plain tensors: each rank checks only its own gradients
        seen[f"local-{strategy}"] = _step(local, strategy, rank, lambda m: m.weight.grad)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here


def test_ranks_agree_on_skipping_an_fp16_step(tmp_path):
    out = str(tmp_path / "seen")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), out), nprocs=2)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    for case in ("fsdp2-fsdp", "local-fsdp", "fsdp2-single"):
        assert [r[case]["stepped"] for r in ranks] == [False, False], case
        assert [r[case]["scale"] for r in ranks] == [2.0**15, 2.0**15], case
    assert ranks[0]["local-fsdp"]["class"] == "ShardedGradScaler"
    # Negative control: without the sharded scaler's all-reduce the ranks disagree.
    assert [r["local-single"]["stepped"] for r in ranks] == [True, False]
    assert [r["local-single"]["scale"] for r in ranks] == [2.0**16, 2.0**15]
