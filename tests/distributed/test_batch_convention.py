"""micro_batch_size is per process: more processes mean a larger global batch, not idle ones.

The workspace's config sets train.global_batch_size=5; these tests unset it to get the
default (micro_batch_size x grad_accum x processes), as most users will.
"""

import json
from pathlib import Path

import pytest
from multiproc import Workspace, train_losses
from test_parity import assert_same_losses, assert_same_weights

DEFAULTS = ("train.global_batch_size=null",)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("batch"), tiny_model_dir)


IDLE = ("train.global_batch_size=1", "train.max_steps=2")
GROWN = (*DEFAULTS, "method.type=full")


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """The module's 2-process runs, made together in one launch: name -> output.dir. The
    run resumed on 2 processes first runs 4 steps on 1 (global batch 2)."""
    workspace.train("grow", *GROWN, "train.max_steps=4")
    runs = [("defaults", (*DEFAULTS, "train.max_steps=2")), ("idle", IDLE), ("grow", GROWN)]
    return workspace.train_together(runs)


def per_rank(out) -> list[dict]:
    return json.loads((out / "keel_run.json").read_text())["per_rank"]


def test_defaults_put_every_process_to_work(workspace, two_processes):
    """micro_batch_size 2 on 2 processes: 4 rows a step, 2 on each, no filler."""
    out, output = two_processes["defaults"], workspace.outputs_together["defaults"]
    assert "global batch 4 rows over 2 process(es)" in output
    assert "filler" not in output
    ranks = per_rank(out)
    assert [r["rows"] for r in ranks] == [4, 4]  # 2 steps x 2 rows
    assert [r["filler_micro_batches"] for r in ranks] == [0, 0]


def test_a_global_batch_that_idles_a_process_is_warned_about(workspace, two_processes):
    """The negative control: a global batch of 1 row leaves rank 1 running filler."""
    out, output = two_processes["idle"], workspace.outputs_together["idle"]
    assert "1 of 2 processes run zero-weight filler micro-batches on every step" in output
    ranks = per_rank(out)
    assert [r["rows"] for r in ranks] == [2, 0]
    assert [r["filler_micro_batches"] for r in ranks] == [0, 2]


def test_resume_on_more_processes_keeps_the_checkpoints_global_batch(workspace, two_processes):
    """1 process (global batch 2) for 4 steps, then 2 processes, whose default would be 4:
    the checkpoint's batch decides, and the run equals an uninterrupted 1-process run."""
    resumed, output = two_processes["grow"], workspace.outputs_together["grow"]
    assert "keeping the checkpoint's global batch of 2 rows" in output
    assert "train.global_batch_size=2" in output
    want = workspace.train("grow-reference", *GROWN)
    assert_same_losses(train_losses(resumed), train_losses(want))
    assert_same_weights(resumed, want)
