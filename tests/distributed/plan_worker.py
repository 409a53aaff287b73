"""Run under torchrun by test_plan_bytes.py: what each rank allocates vs what `keel plan` says.

Each case builds the model with keel's own `build_training_model`, runs one optimizer step
(so AdamW state exists) and sums the bytes of the storages behind this rank's parameters
and buffers, gradients and optimizer state (the local shards of DTensors, padding
included). Writes <out>/rank-<r>.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from keel.config import load_config
from keel.distributed.launch import detect_world
from keel.distributed.process_group import DistContext, exit_now, init_distributed, shutdown
from keel.plan import DeviceSpec, plan_run
from keel.plan.estimate import state_bytes
from keel.precision import Precision
from keel.train.model_setup import build_training_model
from keel.train.optim import build_optimizer

CASES = [
    ("ddp", "full"),
    ("ddp", "lora"),
    ("fsdp", "full"),
    ("fsdp", "lora"),
    ("fsdp", "freeze"),
    ("fsdp", "lora+modules"),
]
# lora+modules: LoRA with the (untied) embeddings and output layer trained in full beside it
FULL_MODULES = ["embed_tokens", "lm_head"]
# on 4 processes: HSDP, 2 copies each sharded over 2 processes (distributed.fsdp.shard_size)
HSDP_CASES = [("fsdp", "full"), ("fsdp", "lora+modules")]
HSDP_SHARD = 2
# also on 4 processes: 2 tensor-parallel groups of 2 (each process holds half of every
# layer's projections, sharded over the 2 groups), on a model whose layers split in two
TP_CASES = [("fsdp", "full"), ("fsdp", "lora")]
TP = 2


def run_config(
    model_dir: Path, strategy: str, method: str, shard_size: int = 0, tensor_parallel: int = 1
) -> dict:
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    if method == "lora+modules":
        method, lora["modules_to_save"] = "lora", FULL_MODULES
    return {
        "model": {"path": str(model_dir)},
        "method": {
            "type": method,
            "lora": lora,
            "freeze": {"trainable_layers": 1},
        },
        "data": {"datasets": ["unused.json"], "cutoff_len": 16},
        "train": {"precision": "fp32", "micro_batch_size": 2},
        "output": {"dir": "unused"},
        "distributed": {
            "strategy": strategy,
            "fsdp": {"shard_size": shard_size},
            "tensor_parallel": tensor_parallel,
        },
    }


def _storage_bytes(tensors) -> int:
    seen = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def allocated(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """[params + buffers, grads, optimizer state] bytes this process holds."""
    params = [*module.parameters(), *module.buffers()]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [_storage_bytes(params), _storage_bytes(grads), _storage_bytes(state)]


def measure(cfg, model_dir: Path, ctx: DistContext) -> list[int]:
    """Build as training does, take one optimizer step, return `allocated`."""
    built = build_training_model(cfg, model_dir, ctx, Precision("fp32", "test"), lambda _m: None)
    optimizer = build_optimizer(built.objective, cfg.train)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = built.objective({"input_ids": ids, "targets": ids, "position_ids": None}).loss
    loss.backward()
    optimizer.step()
    return allocated(built.objective, optimizer)


def predicted(cfg, model_dir: Path, strategy: str, world: int, rank: int) -> dict:
    devices = DeviceSpec(kind="cpu", per_node=world, memory_bytes=2**40)
    plan = plan_run(cfg, model_dir, devices=devices, precision=Precision("fp32", "test"))
    option = plan.option_for("single" if world == 1 else strategy, cfg.method.type, False)
    device = option.per_device
    tp = cfg.distributed.tensor_parallel  # a tensor-parallel group shares a data-parallel rank
    shards = cfg.distributed.fsdp.shard_size or world // tp  # a rank holds its group's share
    census = plan.censuses[cfg.method.type]
    return {
        "per_device": [device.params, device.grads, device.optimizer],
        "rank": list(state_bytes(census, strategy, shards, rank // tp % shards)),
    }


def main(model_dir: Path, out: Path, even_model_dir: Path | None = None) -> None:
    world = detect_world(os.environ)
    ctx = init_distributed(
        rank=world.rank,
        world_size=world.world_size,
        local_rank=world.local_rank,
        local_world_size=world.local_world_size,
        timeout_s=120,
        preprocess_timeout_s=120,
        log=lambda _m: None,
    )
    seen = {}
    hsdp = ctx.world_size == 4
    for strategy, method in HSDP_CASES if hsdp else CASES:
        shard = HSDP_SHARD if hsdp else 0
        cfg = load_config(None, base=run_config(model_dir, strategy, method, shard))
        seen[f"{strategy}-{method}"] = {
            "measured": measure(cfg, model_dir, ctx),
            **predicted(cfg, model_dir, strategy, ctx.world_size, ctx.rank),
        }
    for strategy, method in TP_CASES if hsdp else []:
        cfg = load_config(None, base=run_config(even_model_dir, strategy, method, 0, TP))
        seen[f"tp-{strategy}-{method}"] = {
            "measured": measure(cfg, even_model_dir, ctx),
            **predicted(cfg, even_model_dir, strategy, ctx.world_size, ctx.rank),
        }
    (out / f"rank-{ctx.rank}.json").write_text(json.dumps(seen))
    shutdown(ctx)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), *map(Path, sys.argv[3:]))
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here
