"""fp16 on GPUs without bf16 (field note 4, a 2080 Ti): the choice and its reason, the loss
scaler each strategy gets, and the scaler's state through a checkpoint and a resume."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from keel import precision as prec
from keel.checkpoint.checkpointer import Checkpointer, StatefulParts
from keel.checkpoint.layout import TRAINER
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy
from keel.precision import Precision
from keel.train.loop import Trainer, grad_scaler

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
FP16 = Precision("fp16", "test")


def test_auto_picks_fp16_on_a_gpu_without_bf16_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA GeForce RTX 2080 Ti")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (7, 5))
    choice = prec.resolve_precision("auto", CUDA)
    assert choice.name == "fp16" and choice.autocast_dtype is torch.float16
    assert choice.reason == (
        "auto: NVIDIA GeForce RTX 2080 Ti (compute capability 7.5) has no native bf16 "
        "(8.0+); fp16 with dynamic loss scaling"
    )


def test_auto_picks_bf16_where_the_gpu_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert prec.resolve_precision("auto", CUDA).name == "bf16"


def test_the_scaler_each_strategy_gets():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    cpu = torch.device("cpu")
    for strategy in (Strategy.SINGLE, Strategy.DDP):
        scaler = grad_scaler(cpu, FP16, strategy)
        assert type(scaler) is torch.amp.GradScaler and scaler.is_enabled()
    for strategy in (Strategy.FSDP, Strategy.FSDP_OFFLOAD):
        assert isinstance(grad_scaler(cpu, FP16, strategy), ShardedGradScaler)
    for name in ("fp32", "bf16"):
        for strategy in Strategy:
            assert not grad_scaler(cpu, Precision(name, "test"), strategy).is_enabled()


def _trainer(precision: Precision) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Trainer(
        objective=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0),
        precision=precision,
        device=torch.device("cpu"),
        pad_id=0,
        max_grad_norm=1.0,
    )


def _steps(trainer: Trainer, overflows: list[bool]) -> None:
    """Optimizer steps through the trainer's scaler, some with an overflowing gradient."""
    model, scaler = trainer.objective, trainer.scaler
    for overflow in overflows:
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if overflow:
            model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(trainer.optimizer)
        scaler.step(trainer.optimizer)
        scaler.update()
        trainer.optimizer.zero_grad(set_to_none=True)


def _checkpointer(trainer: Trainer, folder) -> Checkpointer:
    parts = StatefulParts(
        module=trainer.objective,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        scaler=trainer.scaler,
    )
    return Checkpointer(parts, output_dir=folder, keep_last=2, dist=DistContext())


def _save(trainer, folder, step: int):
    return _checkpointer(trainer, folder).save(step, meta={})


def test_the_loss_scale_survives_a_checkpoint_and_a_resume(tmp_path):
    from keel.train.run import _restore

    trainer = _trainer(FP16)
    # Two overflows halve the scale twice; three clean steps grow the tracker to 3.
    _steps(trainer, [True, False, True, False, False, False])
    state = trainer.scaler.state_dict()
    assert state["scale"] == 2.0**14 and state["_growth_tracker"] == 3
    path = _save(trainer, tmp_path, 6)
    assert json.loads((path / TRAINER).read_text())["scaler"] == state
    resumed = _trainer(FP16)
    assert resumed.scaler.get_scale() == 2.0**16  # a fresh scaler
    lines = []
    assert _restore(_checkpointer(resumed, tmp_path), path, lines.append) == 6
    assert resumed.scaler.state_dict() == state
    assert "fp16 loss scale 16384" in lines[-1]
    # The next steps scale the same way in both (same scale, same growth tracker)
    _steps(trainer, [False, True])
    _steps(resumed, [False, True])
    assert resumed.scaler.state_dict() == trainer.scaler.state_dict()
    assert torch.equal(resumed.objective.weight, trainer.objective.weight)


def test_checkpoints_without_a_scaler_still_load(tmp_path):
    trainer = _trainer(Precision("fp32", "test"))
    assert trainer.scaler.state_dict() == {}  # disabled: nothing to save
    path = _save(trainer, tmp_path, 1)
    data = json.loads((path / TRAINER).read_text())
    assert data["scaler"] == {}
    del data["scaler"]  # as an older keel wrote it
    (path / TRAINER).write_text(json.dumps(data))
    restored = _checkpointer(trainer, tmp_path).load(path)
    assert not restored.scaler_restored and restored.step == 1


def test_fp16_with_fsdp_is_accepted(tmp_path):
    from keel.config import load_config

    base = {
        "model": {"path": str(tmp_path)},
        "data": {"datasets": ["d.json"]},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(None, ["train.precision=fp16", "distributed.strategy=fsdp"], base=base)
    assert cfg.train.precision == "fp16" and cfg.distributed.strategy == "fsdp"


@pytest.mark.parametrize("overflow", [True, False])
def test_an_overflowing_step_changes_nothing(overflow):
    trainer = _trainer(FP16)
    before = trainer.objective.weight.detach().clone()
    _steps(trainer, [overflow])
    assert torch.equal(before, trainer.objective.weight) == overflow
