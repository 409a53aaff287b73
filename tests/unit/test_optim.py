"""Learning-rate schedule shapes, step planning, and LoRA+'s parameter groups."""

import pytest
import torch

from keel.config import TrainConfig
from keel.train.optim import (
    build_optimizer,
    build_scheduler,
    describe_optimizer,
    lr_factor,
    warmup_steps_for,
)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_then_decay(kind):
    factors = [lr_factor(s, total_steps=10, warmup=2, kind=kind) for s in range(10)]
    assert factors[0] == pytest.approx(1 / 3) and factors[1] == pytest.approx(2 / 3)
    assert factors[2] == pytest.approx(1.0)
    if kind == "constant":
        assert all(f == 1.0 for f in factors[2:])
    else:
        assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
        assert factors[-1] < 0.2


def test_cosine_midpoint():
    assert lr_factor(5, total_steps=10, warmup=0, kind="cosine") == pytest.approx(0.5)


def test_warmup_ratio_and_steps():
    assert warmup_steps_for(TrainConfig(warmup_ratio=0.1), 50) == 5
    assert warmup_steps_for(TrainConfig(warmup_steps=3, warmup_ratio=0.5), 50) == 3


# --- LoRA+ (method.lora.plus_lr_ratio) -------------------------------------------------


def _lora_model(rslora: bool = False):
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], use_rslora=rslora)
    return get_peft_model(base, config)


@pytest.mark.parametrize("choice", ["adamw", "adamw_8bit"])
def test_lora_plus_puts_the_b_matrices_in_groups_at_ratio_times_lr(choice):
    model = _lora_model()
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, optimizer=choice)
    optimizer = build_optimizer(model, cfg, lora_plus_ratio=16.0)
    names = {id(p): n for n, p in model.named_parameters()}
    (main,) = [g for g in optimizer.param_groups if g["lr_scale"] == 1.0]  # A: 2-D, decays
    (plus,) = [g for g in optimizer.param_groups if g["lr_scale"] == 16.0]
    assert optimizer.param_groups[0] is main  # the lr keel logs is train.lr's
    assert all(".lora_A." in names[id(p)] for p in main["params"])
    assert sorted(names[id(p)].split(".")[-3] for p in plus["params"]) == ["lora_B"] * 2
    assert float(plus["lr"]) == pytest.approx(16e-3) and plus["weight_decay"] == 0.1
    assert "LoRA+: the 2 LoRA B matrices learn at 16 x train.lr" in describe_optimizer(
        optimizer, choice
    )
    scheduler = build_scheduler(optimizer, TrainConfig(lr=1e-3, scheduler="cosine"), 10)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    assert float(plus["lr"]) == pytest.approx(16 * float(main["lr"])) and float(main["lr"]) < 1e-3
    # without a ratio: one lr, the groups as before (decay, no decay)
    same = build_optimizer(model, cfg)
    assert [g["lr_scale"] for g in same.param_groups] == [1.0]
    assert "LoRA+" not in describe_optimizer(same, choice)


def test_lora_plus_moves_b_by_ratio_times_lr_on_the_first_step():
    """Adam's first update is lr x sign(grad) per entry: B moves 16x as far as it would."""
    moved = {}
    for ratio in (None, 16.0):
        model = _lora_model()
        optimizer = build_optimizer(model, TrainConfig(lr=1e-3), lora_plus_ratio=ratio)
        b = model.base_model.model[0].lora_B["default"].weight
        before = b.detach().clone()
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        moved[ratio] = (b.detach() - before).abs().max().item()
    assert moved[None] == pytest.approx(1e-3, rel=1e-3)
    assert moved[16.0] == pytest.approx(16e-3, rel=1e-3)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_min_lr_ratio_is_the_floor_the_decay_ends_at(kind):
    def factors(floor):
        return [lr_factor(s, total_steps=10, warmup=2, kind=kind, floor=floor) for s in range(12)]

    plain, floored = factors(0.0), factors(0.1)
    assert floored[:3] == plain[:3]  # warmup and the peak are the same
    assert floored[10:] == pytest.approx([0.1, 0.1]) and plain[10:] == [0.0, 0.0]
    # the same shape, squeezed into [0.1, 1]
    assert floored[2:] == pytest.approx([0.1 + 0.9 * f for f in plain[2:]])
    assert lr_factor(5, total_steps=10, warmup=0, kind="constant", floor=0.1) == 1.0
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, TrainConfig(lr=1.0))
    scheduler = build_scheduler(optimizer, TrainConfig(lr=1.0, min_lr_ratio=0.1, scheduler=kind), 4)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
