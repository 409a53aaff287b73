"""Offloaded checkpointing under FSDP2 on 2 gloo processes: the same loss and gradient
shards as plain checkpointing (the hooks are per layer and local; FSDP2's unshard and
reshard hooks run outside the checkpointed forward)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import build_tiny_model

from keel.distributed.process_group import exit_now
from keel.models.loading import enable_activation_checkpointing
from keel.models.offload import HostOffload, offload_checkpointed_inputs


class Counting(HostOffload):
    def __init__(self):
        super().__init__("cpu")
        self.packed = 0

    def pack(self, tensor):
        self.packed += 1
        return super().pack(tensor)


def _run(offload: HostOffload | None, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_tiny_model(97, seed=5, layers=2)
    model.train()
    enable_activation_checkpointing(model)
    if offload is not None:
        offload_checkpointed_inputs(model, offload)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.to_local() for p in model.parameters()]
    return loss.detach(), grads


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    loss, grads = _run(None, world)
    offload = Counting()
    loss_off, grads_off = _run(offload, world)
    same = torch.equal(loss, loss_off) and all(map(torch.equal, grads, grads_off))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"same": same, "packed": offload.packed}, f)
    dist.destroy_process_group()
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here


def test_offload_under_fsdp2_matches_plain_checkpointing(tmp_path):
    out = str(tmp_path / "seen")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), out), nprocs=2)
    for rank in range(2):
        seen = json.loads(open(f"{out}.{rank}").read())
        assert seen == {"same": True, "packed": 2}  # one input per layer, on every rank
