"""`keel plan` counts train.optimizer's state: the bytes torchao's 8/4-bit AdamW allocates.

The tiny decoder shape (hidden 64) as a Llama: embeddings, q/o and MLP weights have
quantised moments, k/v (2,048 values) and norms keep fp32 ones. Shares its shapes, and so
its compiled optimizer updates, with test_optim_lowbit.py.
"""

import pytest
import torch
from test_optim_lowbit import save_lowbit_llama

from keel.config import load_config
from keel.distributed.process_group import DistContext
from keel.plan import DeviceSpec, plan_run
from keel.plan.estimate import state_bytes
from keel.precision import Precision
from keel.quant import import_torchao
from keel.quant.optim_state import LOW_BIT
from keel.train.model_setup import build_training_model
from keel.train.optim import build_optimizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_lowbit_llama(tmp_path_factory.mktemp("lowbit-plan"))


def config(model_dir, optimizer: str):
    return load_config(
        None,
        base={
            "model": {"path": str(model_dir)},
            "method": {"type": "full"},
            "data": {"datasets": ["unused.json"], "cutoff_len": 16},
            "train": {"precision": "fp32", "micro_batch_size": 2, "optimizer": optimizer},
            "output": {"dir": "unused"},
        },
    )


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor; a torchao subclass counts its inner tensors (codes,
    scales, code book)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if type(value) is torch.Tensor:
                total += value.untyped_storage().nbytes()
            elif torch.is_tensor(value):
                inner, _ = value.__tensor_flatten__()
                total += sum(getattr(value, name).untyped_storage().nbytes() for name in inner)
    return total


def one_step(optimizer: torch.optim.Optimizer, params) -> None:
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


@pytest.mark.parametrize("choice", ["adamw", "adamw_8bit", "adamw_4bit", "muon"])
def test_the_plan_counts_what_the_optimizer_allocates(model_dir, choice):
    cfg = config(model_dir, choice)
    devices = DeviceSpec(kind="cpu", per_node=1, memory_bytes=2**40)
    plan = plan_run(cfg, model_dir, devices=devices, precision=Precision("fp32", "test"))
    assert plan.work.optimizer == choice
    want = plan.option_for("single", "full", False).per_device.optimizer

    built = build_training_model(cfg, model_dir, DistContext(), Precision("fp32", "test"), print)
    optimizer = build_optimizer(built.objective, cfg.train)
    one_step(optimizer, [p for p in built.objective.parameters() if p.requires_grad])
    assert state_nbytes(optimizer) == want
    # By hand: 94,528 values in 20 tensors; 11 of them quantised (embeddings 320x64, per
    # layer q/o 64x64 and gate/up/down 128x64), the other 9 (k/v 32x64, norms) kept fp32.
    quantised = 320 * 64 + 2 * (2 * 64 * 64 + 3 * 128 * 64)
    kept_fp32 = 2 * 4 * (94_528 - quantised)  # both moments
    steps = 4 * 20
    by_hand = {
        "adamw": 2 * 4 * 94_528 + steps,  # 756,304
        # codes + one fp32 scale per block + a 256- (8-bit) or 16-entry (4-bit) code book
        "adamw_8bit": 2 * (quantised + 4 * quantised // 256 + 11 * 4 * 256) + kept_fp32 + steps,
        "adamw_4bit": 2 * (quantised // 2 + 4 * quantised // 128 + 11 * 4 * 16) + kept_fp32 + steps,
        # Muon: one fp32 buffer for the 14 matrices (73,728 values), AdamW for the
        # embeddings and norms (20,800); a step each
        "muon": 4 * 73_728 + 2 * 4 * 20_800 + steps,
    }
    assert want == by_hand[choice]  # 756,304 / 265,424 / 160,976 / 461,392 bytes


@pytest.mark.parametrize("choice", ["adamw_8bit", "adamw_4bit"])
def test_under_fsdp_the_rule_applies_to_each_shard(model_dir, choice):
    """torchao decides on `DTensor.to_local()`: on 2 processes a 64x64 q_proj is two
    2,048-value shards, below 4,096, so its moments stay fp32 there. Each rank's planned
    state equals what torchao allocates for tensors of that rank's unpadded shard shapes."""
    cfg = config(model_dir, choice)
    devices = DeviceSpec(kind="cpu", per_node=2, memory_bytes=2**40)
    census = plan_run(
        cfg, model_dir, devices=devices, precision=Precision("fp32", "test")
    ).censuses["full"]
    optim = import_torchao("optim", needed_for="this test")
    for rank in range(2):
        shards = []
        for t in census.tensors:
            if t.trainable:
                chunk = -(-t.shape[0] // 2)
                rows = max(0, min(chunk, t.shape[0] - rank * chunk))
                shards.append(torch.nn.Parameter(torch.zeros(rows, *t.shape[1:])))
        optimizer = getattr(optim, LOW_BIT[choice].cls)(shards)
        one_step(optimizer, shards)
        assert state_nbytes(optimizer) == state_bytes(census, "fsdp", 2, rank, optimizer=choice)[2]
    whole = state_bytes(census, "single", 1, optimizer=choice)[2]
    sharded = state_bytes(census, "fsdp", 2, 0, optimizer=choice)[2]
    assert sharded > whole / 2  # the q/o projections' shards fell back to fp32
