"""precision: auto picks from a measurement, says why, and refuses what cannot run."""

import pytest
import torch

from keel.errors import ConfigError
from keel.train import precision as prec

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
