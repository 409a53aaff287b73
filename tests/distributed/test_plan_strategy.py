"""With distributed.strategy auto, the memory plan's choice is what trains."""

import json

import pytest
from multiproc import Workspace

from keel.config import load_config
from keel.plan import devices_for_run, plan_run
from keel.precision import Precision


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("plan"), tiny_model_dir)


def test_auto_shards_when_a_replica_does_not_fit(workspace):
    """Per-device memory between what FSDP and what DDP need: auto must pick fsdp."""
    overrides = ["method.type=full", "distributed.strategy=auto"]
    cfg = load_config(workspace.config, overrides)
    devices = devices_for_run("cpu", world_size=2, local_world_size=2)
    plan = plan_run(cfg, devices=devices, precision=Precision("fp32", "test"))
    ddp = plan.option_for("ddp", "full", False).per_device.total
    fsdp = plan.option_for("fsdp", "full", False).per_device.total
    assert fsdp < ddp
    between = int((ddp + fsdp) / 2 / 0.9)  # usable memory is 90% of the device's
    # The negative control: with room for a replica, auto replicates.
    runs = workspace.train_together(
        [
            ("auto", (*overrides, f"distributed.device_memory={between}")),
            ("roomy", (*overrides, f"distributed.device_memory={2 * ddp}")),
        ]
    )
    assert json.loads((runs["auto"] / "keel_run.json").read_text())["strategy"] == "fsdp"
    assert "plan: fsdp + full" in workspace.outputs_together["auto"]
    assert json.loads((runs["roomy"] / "keel_run.json").read_text())["strategy"] == "ddp"
