"""Rollout generation under FSDP2 on 2 gloo processes (keel.train.rollout_generation): every
unit gathered once, then generation makes no collective, so ranks decoding different numbers
of tokens do not hang; the tokens equal the unsharded model's; training works afterwards."""

from __future__ import annotations

import copy
import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import build_tiny_tokenizer
from serve_support import varied_tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from keel.distributed.parallelize import ParallelizeSettings, apply_fsdp, fsdp_units
from keel.distributed.process_group import DistContext, exit_now
from keel.distributed.strategy import Strategy
from keel.distributed.watchdog import Progress
from keel.infer.batch_generate import GroupRequest, Sampling, generate_groups
from keel.train.objective import CausalLMObjective
from keel.train.rollout_generation import generation_ready

PROMPTS = ["Who are you?", "0 1 2", "Give three tips for staying healthy."]
JOIN_TIMEOUT_S = 420  # a hang fails the test instead of the CI job
# Rank r's completions: rank 1 decodes 5x more tokens than rank 0.
MAX_TOKENS = {0: 4, 1: 20}


class GatherWatch(Progress):
    """Progress that notes the watchdog phase (name, limit) each unit's gather is made in."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers_in: list = []

    def mark(self, where) -> None:
        super().mark(where)
        if isinstance(where, tuple) and where[0] == "weight gather":
            self.gathers_in.append(self.phases[-1][:2] if self.phases else None)


def _rollouts(model, tokenizer, rank: int) -> list[list[list[int]]]:
    sampling = Sampling(max_tokens=MAX_TOKENS[rank], temperature=1.0)
    requests = [
        GroupRequest(prompt_ids=tokenizer.encode(p), n=3, seed=11 + 10 * i)
        for i, p in enumerate(PROMPTS)
    ]
    groups = generate_groups(model, tokenizer, requests, sampling, max_batch_size=9)
    return [[c.token_ids for c in group] for group in groups]


def _batch() -> dict:
    ids = torch.arange(3, 15)[None] + 17 * dist.get_rank()  # [1, 12], another row per rank
    return {
        "input_ids": ids,
        "targets": torch.roll(ids, -1, dims=1),
        "position_ids": torch.arange(12)[None],
    }


def _train_step(objective) -> tuple[float, list[torch.Tensor]]:
    objective.train()
    out = objective(_batch())
    out.loss.backward()
    grads = [p.grad.to_local().clone() for p in objective.parameters()]
    objective.zero_grad(set_to_none=True)
    return out.loss.item(), grads


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tokenizer = build_tiny_tokenizer()
    model = varied_tiny_model(len(tokenizer))
    expected = _rollouts(copy.deepcopy(model).eval(), tokenizer, rank)  # unsharded, one process
    unsharded_loss = CausalLMObjective(copy.deepcopy(model).train())(_batch()).loss.item()
    objective = CausalLMObjective(model)
    units = fsdp_units(model, model.model.layers, embeddings=True)
    settings = ParallelizeSettings(strategy=Strategy.FSDP, units=units)
    apply_fsdp(objective, units, init_device_mesh("cpu", (world,)), settings)
    ctx, progress = DistContext(rank=rank, world_size=world), GatherWatch()
    seen: dict = {"rollouts": []}
    # Before any training forward (FSDP has not chosen its root yet), and after one.
    for _ in range(2):
        with generation_ready(objective, dist=ctx, progress=progress, gather_limit=60) as policy:
            seen["eval_inside"] = not policy.training
            seen["rollouts"].append(_rollouts(policy, tokenizer, rank))
        seen["sharded_after"] = all(isinstance(p, DTensor) for p in objective.parameters())
        seen.setdefault("steps", []).append(_train_step(objective))
    (loss_a, grads_a), (loss_b, grads_b) = seen.pop("steps")
    seen["same_step"] = loss_a == loss_b and all(map(torch.equal, grads_a, grads_b))
    seen["loss_vs_unsharded"] = abs(loss_a - unsharded_loss) / unsharded_loss
    seen["grads"] = len(grads_a)
    seen["equal_unsharded"] = all(r == expected for r in seen.pop("rollouts"))
    seen["lengths"] = sorted({len(ids) for group in expected for ids in group})
    seen["gathers_in"] = progress.gathers_in
    seen["units"] = sum(isinstance(m, FSDPModule) for m in objective.modules())
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here


def test_generation_under_fsdp2_is_local_and_equals_the_unsharded_model(tmp_path):
    out = str(tmp_path / "seen")
    context = mp.start_processes(
        _worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("the ranks hung: generation made a collective out of step")
    for rank in range(2):
        seen = json.loads(open(f"{out}.{rank}").read())
        assert seen["equal_unsharded"] and seen["eval_inside"] and seen["sharded_after"]
        assert seen["same_step"] and seen["grads"] > 0
        assert seen["loss_vs_unsharded"] < 1e-6
        assert max(seen["lengths"]) <= MAX_TOKENS[rank]
        # a rank stuck in the gather is a hang the watchdog reports: every unit's gather
        # (2 generations) is a progress mark inside the watched phase, with its limit
        assert seen["gathers_in"] == [["weight gather", 60]] * (2 * seen["units"])
    assert max(json.loads(open(f"{out}.1").read())["lengths"]) == MAX_TOKENS[1]
