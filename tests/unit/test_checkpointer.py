"""The Checkpointer seam: every part registered with it goes through a checkpoint and back,
and a checkpoint lacking a registered part is refused, naming it, before anything changes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from keel.checkpoint.checkpointer import Checkpointer, StatefulParts
from keel.checkpoint.layout import PROCESS_DIR, TRAINER, complete_checkpoints
from keel.checkpoint.verify import verify_checkpoint
from keel.distributed.process_group import DistContext
from keel.errors import CheckpointError


class Cursor:
    """A stand-in for a batch source: plain state that only a checkpoint can carry over."""

    def __init__(self, position: int = 0):
        self.position, self.seen = position, [position]

    def state_dict(self) -> dict:
        return {"position": self.position, "seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.seen = state["position"], list(state["seen"])


def _checkpointer(folder, seed: int, **extras) -> Checkpointer:
    torch.manual_seed(seed)
    module = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    parts = StatefulParts(module=module, optimizer=optimizer, scheduler=scheduler)
    checkpointer = Checkpointer(parts, output_dir=folder, keep_last=2, dist=DistContext())
    for name, part in extras.items():
        checkpointer.register(name, part)
    return checkpointer


def _train(checkpointer: Checkpointer, steps: int) -> None:
    parts = checkpointer.parts
    for _ in range(steps):
        parts.module(torch.ones(2, 4)).sum().backward()
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)


def test_a_registered_part_is_saved_and_restored(tmp_path):
    saved = _checkpointer(tmp_path, seed=0, batches=Cursor())
    _train(saved, 3)
    saved.parts.extras["batches"].position = 42
    saved.parts.extras["batches"].seen.append(7)
    path = saved.save(3, meta={"run": "test"})
    trainer = json.loads((path / TRAINER).read_text())
    assert trainer["parts"] == {"batches": {"position": 42, "seen": [0, 7]}}

    cursor = Cursor()
    resumed = _checkpointer(tmp_path, seed=1, batches=cursor)  # other weights, fresh parts
    restored = resumed.load(path)
    assert restored.step == 3 and not restored.scaler_restored
    assert (cursor.position, cursor.seen) == (42, [0, 7])
    assert resumed.parts.scheduler.state_dict() == saved.parts.scheduler.state_dict()
    for mine, theirs in zip(
        resumed.parts.module.parameters(), saved.parts.module.parameters(), strict=True
    ):
        assert torch.equal(mine, theirs)
    assert resumed.newest() == path and complete_checkpoints(tmp_path) == [path]


def test_a_checkpoint_without_a_registered_part_is_refused_naming_it(tmp_path):
    path = _checkpointer(tmp_path, seed=0).save(1, meta={})  # as keel wrote it before parts
    trainer = json.loads((path / TRAINER).read_text())
    assert set(trainer) == {"step", "scheduler", "scaler"}  # no extras: the format is as it was
    cursor = Cursor(5)
    resumed = _checkpointer(tmp_path, seed=1, batches=cursor)
    before = [p.detach().clone() for p in resumed.parts.module.parameters()]
    with pytest.raises(CheckpointError, match=r"holds no state for 'batches'.*train.resume=never"):
        resumed.load(path)
    assert cursor.position == 5  # refused before anything was loaded
    assert all(
        torch.equal(a, b) for a, b in zip(before, resumed.parts.module.parameters(), strict=True)
    )


def test_saves_keep_the_newest_and_register_refuses_a_second_part_of_a_name(tmp_path):
    checkpointer = _checkpointer(tmp_path, seed=0, batches=Cursor())
    for step in (1, 2, 3):
        checkpointer.save(step, meta={})
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    with pytest.raises(AssertionError, match="batches"):
        checkpointer.register("batches", Cursor())


def test_a_part_registered_missing_ok_keeps_its_state_when_a_checkpoint_lacks_it(tmp_path):
    path = _checkpointer(tmp_path, seed=0).save(1, meta={})  # as keel wrote it before parts
    order, cursor = Cursor(3), Cursor(5)
    resumed = _checkpointer(tmp_path, seed=1)
    resumed.register("order", order, missing_ok=True)
    assert resumed.load(path).step == 1 and order.position == 3  # its own state, unchanged
    resumed.register("batches", cursor)  # a required part is still refused, and named alone
    with pytest.raises(CheckpointError, match=r"holds no state for 'batches',"):
        resumed.load(path)


class InFlight:
    """A stand-in for grpo's rollout: per-process state, present only at some steps."""

    def __init__(self, rows: list[float] | None = None):
        self.rows, self.loaded = rows, None

    def process_state_dict(self) -> dict | None:
        return None if self.rows is None else {"rows": self.rows}

    def load_process_state_dicts(self, states: list[dict]) -> None:
        self.loaded = states


def test_a_per_process_part_is_saved_by_each_process_hashed_and_given_back(tmp_path):
    # floats JSON must carry exactly (a rollout's old log-probs): float32 values included
    rows = [0.1, -1.0e-30, float(torch.tensor(1 / 3, dtype=torch.float32)), 2.5e38]
    saved = _checkpointer(tmp_path, seed=0)
    saved.register_per_process("rollout", InFlight(rows))
    _train(saved, 1)
    path = saved.save(1, meta={})
    written = path / PROCESS_DIR / "rank-00000.json"
    assert json.loads(written.read_text()) == {"rollout": {"rows": rows}}
    assert "processes/rank-00000.json" in verify_checkpoint(path)["sha256"]

    part = InFlight()
    resumed = _checkpointer(tmp_path, seed=1)
    resumed.register_per_process("rollout", part)
    resumed.load(path)
    assert part.loaded == [{"rows": rows}]  # every process's state, in rank order

    written.write_text(json.dumps({"rollout": {"rows": [0.0]}}))  # an edit is refused
    with pytest.raises(CheckpointError, match=r"rank-00000.json was changed after keel wrote"):
        verify_checkpoint(path)


def test_a_per_process_part_with_nothing_to_save_writes_nothing_and_loads_empty(tmp_path):
    saved = _checkpointer(tmp_path, seed=0)
    saved.register_per_process("rollout", InFlight(None))
    path = saved.save(2, meta={})
    assert not (path / PROCESS_DIR).exists()
    part = InFlight([1.0])
    resumed = _checkpointer(tmp_path, seed=1)
    resumed.register_per_process("rollout", part)
    resumed.load(path)
    assert part.loaded == []
