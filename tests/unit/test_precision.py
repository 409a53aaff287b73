"""precision: auto picks from a measurement, says why, and refuses what cannot run."""

import hashlib
import json

import pytest
import torch

from keel import precision as prec
from keel.checkpoint.identity import run_identity
from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
from keel.errors import ConfigError
from keel.precision import Precision
from keel.train.reference import reference_fingerprint

CPU = torch.device("cpu")


def test_auto_picks_fp32_when_bf16_is_slow(monkeypatch):
    monkeypatch.setattr(prec, "cpu_bf16_speedup", lambda: (163.0, 1.3))  # AVX2-only machine
    choice = prec.resolve_precision("auto", CPU)
    assert choice.name == "fp32" and choice.autocast_dtype is None
    assert "1 GFLOP/s" in choice.reason and "163 GFLOP/s" in choice.reason


def test_auto_picks_bf16_when_hardware_bf16_is_fast(monkeypatch):
    monkeypatch.setattr(prec, "cpu_bf16_speedup", lambda: (160.0, 310.0))  # AMX machine
    choice = prec.resolve_precision("auto", CPU)
    assert choice.name == "bf16" and choice.autocast_dtype is torch.bfloat16


def test_auto_stays_fp32_when_bf16_is_only_slightly_faster(monkeypatch):
    monkeypatch.setattr(prec, "cpu_bf16_speedup", lambda: (160.0, 200.0))
    assert prec.resolve_precision("auto", CPU).name == "fp32"


def test_explicit_choices():
    assert prec.resolve_precision("bf16", CPU).name == "bf16"
    with pytest.raises(ConfigError, match="fp16 is not supported on a CPU"):
        prec.resolve_precision("fp16", CPU)


def test_probe_returns_positive_rates():
    fp32, bf16 = prec.cpu_bf16_speedup()
    assert fp32 > 0 and bf16 > 0


@pytest.mark.parametrize(
    "name,dtype,itemsize",
    [("fp32", torch.float32, 4), ("bf16", torch.bfloat16, 2), ("fp16", torch.float16, 2)],
)
def test_a_resolved_precision_carries_its_compute_dtype(name, dtype, itemsize):
    """The one type the planner, QLoRA and the loop read their dtypes from."""
    choice = Precision(name, "test")
    assert choice.compute_dtype is dtype and choice.compute_itemsize == itemsize
    assert (choice.autocast_dtype is None) == (name == "fp32")


def test_an_unresolved_precision_is_not_a_precision():
    with pytest.raises(AssertionError, match="unresolved"):
        Precision("auto", "test")


def test_only_the_name_goes_to_disk(tmp_path):
    """Checkpoint meta and reference-cache keys hold the same string the code wrote before
    the type existed, whatever the reason: old checkpoints resume, old caches still hit."""
    (tmp_path / "config.json").write_text("{}")
    cfg = RunConfig(
        model=ModelConfig(path=str(tmp_path)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "run")),
    )
    measured = Precision("bf16", "auto: measured")
    identity = run_identity(cfg, tmp_path, measured, "data")
    assert identity.to_meta()["run"]["precision"] == "bf16"
    key = reference_fingerprint("data", tmp_path, measured)
    assert key == reference_fingerprint("data", tmp_path, Precision("bf16", "set by config"))
    stat = (tmp_path / "config.json").stat()
    before = json.dumps(
        {
            "data": "data",
            "model": str(tmp_path.resolve()),
            "files": [["config.json", stat.st_size, stat.st_mtime_ns]],
            "precision": "bf16",
        },
        sort_keys=True,
    )
    assert key == hashlib.sha256(before.encode()).hexdigest()[:24]
