"""Run under torchrun by test_muon_fsdp.py: Muon steps on row shards (DTensor, Shard(0))
of a matrix with rows that do not split evenly and of a fused experts weight, and the
same steps on the whole tensors in one process. Rank 0 writes both to <out>/muon.pt."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from keel.distributed.process_group import exit_now
from keel.train.muon import MuonAdamW, orthogonalise

SHAPES = {"matrix": (37, 20), "experts": (4, 6, 10)}
STEPS = 3


def gradients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def run(params: dict[str, torch.Tensor], shard) -> dict[str, torch.Tensor]:
    """STEPS Muon steps on `params` (each wrapped by `shard`), whole tensors back."""
    held = {name: torch.nn.Parameter(shard(value)) for name, value in params.items()}
    groups = [{"params": list(held.values()), "weight_decay": 0.1, "muon": True}]
    optimizer = MuonAdamW(groups, lr=0.02)
    for step in range(STEPS):
        for name, param in held.items():
            param.grad = shard(gradients(step)[name])
        optimizer.step()
    return {
        name: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        for name, p in held.items()
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)
    start = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    sharded = run(start, lambda t: distribute_tensor(t, mesh, [Shard(0)]))
    whole = run(start, lambda t: t.clone())
    # what a step would be if each process orthogonalised only the rows it holds
    rows = torch.tensor_split(gradients(0)["matrix"], dist.get_world_size())
    per_shard = torch.cat([orthogonalise(part) for part in rows])
    if dist.get_rank() == 0:
        torch.save(
            {"sharded": sharded, "whole": whole, "per_shard": per_shard,
             "orthogonalised": orthogonalise(gradients(0)["matrix"])},
            out / "muon.pt",
        )  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here
