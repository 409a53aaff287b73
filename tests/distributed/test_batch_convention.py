"""micro_batch_size is per process: more processes mean a larger global batch, not idle ones.

The workspace's config sets train.global_batch_size=5; these tests unset it to get the
default (micro_batch_size x grad_accum x processes), as most users will.
"""

import json

import pytest
from multiproc import Workspace, train_losses
from test_parity import assert_same_losses, assert_same_weights

DEFAULTS = ("train.global_batch_size=null",)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("batch"), tiny_model_dir)


def per_rank(out) -> list[dict]:
    return json.loads((out / "keel_run.json").read_text())["per_rank"]


def test_defaults_put_every_process_to_work(workspace):
    """micro_batch_size 2 on 2 processes: 4 rows a step, 2 on each, no filler."""
    out = workspace.train("defaults", *DEFAULTS, "train.max_steps=2", nproc=2)
    assert "global batch 4 rows over 2 process(es)" in workspace.last_output
    assert "filler" not in workspace.last_output
    ranks = per_rank(out)
    assert [r["rows"] for r in ranks] == [4, 4]  # 2 steps x 2 rows
    assert [r["filler_micro_batches"] for r in ranks] == [0, 0]


def test_a_global_batch_that_idles_a_process_is_warned_about(workspace):
    """The negative control: a global batch of 1 row leaves rank 1 running filler."""
    out = workspace.train("idle", "train.global_batch_size=1", "train.max_steps=2", nproc=2)
    assert (
        "1 of 2 processes run zero-weight filler micro-batches on every step"
        in workspace.last_output
    )
    ranks = per_rank(out)
    assert [r["rows"] for r in ranks] == [2, 0]
    assert [r["filler_micro_batches"] for r in ranks] == [0, 2]


def test_resume_on_more_processes_keeps_the_checkpoints_global_batch(workspace):
    """1 process (global batch 2) for 4 steps, then 2 processes, whose default would be 4:
    the checkpoint's batch decides, and the run equals an uninterrupted 1-process run."""
    workspace.train("grow", *DEFAULTS, "train.max_steps=4", "method.type=full")
    resumed = workspace.train("grow", *DEFAULTS, "method.type=full", nproc=2)
    assert "keeping the checkpoint's global batch of 2 rows" in workspace.last_output
    assert "train.global_batch_size=2" in workspace.last_output
    want = workspace.train("grow-reference", *DEFAULTS, "method.type=full")
    assert_same_losses(train_losses(resumed), train_losses(want))
    assert_same_weights(resumed, want)
