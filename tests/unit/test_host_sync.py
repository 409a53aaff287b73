"""The training step reads nothing back from the device except on logging steps.

On a GPU every `.item()` (or float(), .tolist(), bool() of a tensor) waits for all queued
work: one per micro-batch is a stall per micro-batch. The loop keeps losses and gradient
norms as tensors and reduces them when it logs. These tests count such reads per step.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from keel.config import load_config
from keel.train.loop import Trainer
from keel.train.run import run_training

READS = ("item", "tolist", "__float__", "__int__", "__bool__")
# Reads that are not keel's and not device syncs, or not yet avoidable:
ALLOWED = {
    # torch's Adam keeps its step counters as host tensors on purpose; reading them waits
    # for nothing.
    ("optimizer.py", "_get_value"),
    # transformers checks position ids for packed rows with a bool() of a device tensor;
    # keel passes position ids only for packed batches (varlen attention on GPU will
    # replace this check).
    ("masking_utils.py", "find_packed_sequence_indices"),
}


@pytest.fixture
def data_file(tmp_path):
    rows = [
        {"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(8)
    ]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(rows))
    return path


def _caller() -> tuple[str, str]:
    frame = sys._getframe(2)  # counted() <- the code reading the tensor
    return Path(frame.f_code.co_filename).name, frame.f_code.co_name


def reads_per_step(model_dir, data_file, out, monkeypatch, *overrides) -> dict[int, int]:
    """step -> host reads of tensors made while running it (from entering the step's
    train_step to the end of the loop iteration)."""
    counter = {"reads": 0, "on": False}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if counter["on"] and _caller() not in ALLOWED:
                counter["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    train_step = Trainer.train_step

    def step_starts(self, *args, **kwargs):
        counter["on"] = True
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", step_starts)
    per_step = {}

    def step_ends(step, _record):
        per_step[step] = counter["reads"]
        counter.update(reads=0, on=False)

    base = {
        "model": {"path": str(model_dir), "cache_dir": str(out.parent / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.1}},
        "data": {"datasets": [str(data_file)], "cutoff_len": 64},
        "train": {
            "max_steps": 6,
            "micro_batch_size": 1,
            "grad_accum": 2,
            "lr": 1e-2,
            "precision": "fp32",
            "threads": 1,
        },
        "output": {"dir": str(out), "log_every": 3},
    }
    run_training(
        load_config(None, list(overrides), base=base), log=lambda _m: None, on_step_end=step_ends
    )
    return per_step


@pytest.mark.parametrize(
    "overrides",
    [(), ("data.packing=true", "method.type=full", "train.max_grad_norm=0")],
    ids=["lora-unpacked", "full-packed-noclip"],
)
def test_no_host_reads_outside_logging_steps(
    tiny_model_dir, data_file, tmp_path, monkeypatch, overrides
):
    per_step = reads_per_step(tiny_model_dir, data_file, tmp_path / "run", monkeypatch, *overrides)
    assert sorted(per_step) == [1, 2, 3, 4, 5, 6]
    assert {step: per_step[step] for step in (1, 2, 4, 5)} == {1: 0, 2: 0, 4: 0, 5: 0}
    assert per_step[3] > 0  # the logging step reads the losses of steps 1-3 at once


def test_the_count_sees_reads_negative_control(tiny_model_dir, data_file, tmp_path, monkeypatch):
    """Logging every step reads every step: the counter is not blind."""
    per_step = reads_per_step(
        tiny_model_dir, data_file, tmp_path / "run", monkeypatch, "output.log_every=1"
    )
    assert all(per_step[step] > 0 for step in range(1, 7))
