"""`keel train` plans first: a run that does not fit is refused before any weight is read."""

import json

import pytest
import yaml
from cli_support import keel_in_process

from keel.config import load_config
from keel.models.materialize import CheckpointReader
from keel.plan import DoesNotFit
from keel.train.run import run_training

ROWS = [{"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(6)]
TOO_SMALL = "distributed.device_memory=256MiB"  # the process alone needs ~0.5 GiB


@pytest.fixture
def base(tmp_path, tiny_model_dir) -> dict:
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(ROWS))
    return {
        "model": {"path": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
        "method": {"type": "full"},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "precision": "fp32", "threads": 1},
        "output": {"dir": str(tmp_path / "out")},
    }


def test_a_run_that_does_not_fit_is_refused_before_loading(base, tmp_path, monkeypatch):
    read = []
    monkeypatch.setattr(CheckpointReader, "get", lambda *a, **k: read.append(a))
    logs = []
    with pytest.raises(DoesNotFit) as info:
        run_training(load_config(None, [TOO_SMALL], base=base), log=logs.append)
    message = str(info.value)
    assert "needs" in message and "GiB per device of" in message
    assert "distributed.plan=warn" in message  # how to train anyway
    assert info.value.exit_code == 2
    assert read == []  # no weight was read
    assert not (tmp_path / "out").exists()


def test_the_plan_is_logged_when_it_fits(base):
    logs = []
    run_training(load_config(None, [], base=base), log=logs.append)
    assert any(line.startswith("plan: single + full") for line in logs), logs


def test_distributed_plan_warn_trains_anyway(base):
    logs = []
    result = run_training(
        load_config(None, [TOO_SMALL, "distributed.plan=warn"], base=base), log=logs.append
    )
    assert len(result.losses) == 2
    assert any(line.startswith("warning:") and "training anyway" in line for line in logs)


def test_force_on_the_command_line(base, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base))
    refused = keel_in_process("train", str(config), TOO_SMALL)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "the smallest change that fits" in refused.stderr
    forced = keel_in_process("train", str(config), TOO_SMALL, "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert (tmp_path / "out/keel_run.json").is_file()
