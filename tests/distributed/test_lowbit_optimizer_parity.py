"""train.optimizer adamw_8bit under FSDP2 (`keel train --nproc 2`, gloo): 2 processes
compute what 1 process computes, and a 2-process run resumed from a checkpoint continues
it exactly.

The tiny Llama under full fine-tuning: its embeddings (320x32, tied) are the one weight
with >= 4096 values, and each process's shard (160x32 = 5120 values, 20 blocks of 256)
still is, so quantised moments are sharded as DTensors, saved per process and loaded
back; the other 19 tensors keep fp32 moments (torchao's rule). The runs: 1 process, 2
processes, and a 2-process run stopped after step 4 then resumed.
"""

from pathlib import Path

import pytest
import torch
from multiproc import Workspace, eval_losses, train_losses
from safetensors.torch import load_file

LOWBIT = ("method.type=full", "train.optimizer=adamw_8bit", "distributed.strategy=fsdp")
# 2 vs 1 process, losses: fp32 AdamW's parity bound (test_parity.py); measured <= 3.5e-7
# relative over 6 steps and the eval.
REL = 1e-5
# Weights, where 8-bit moments decide: gradients summed in another order now and then put a
# moment on the other side of a code boundary, which moves that weight by a fraction of one
# step's update (lr 1e-2): measured 15-21 of the embeddings' 10,240 values, by <= 1.0e-3.
# Allowed: <= 1% of a quantised tensor's values beyond fp32 parity's bounds, by <= 2e-3.
QUANTISED = {"model.embed_tokens.weight"}
# The other weights keep fp32 moments, but the moved embedding values change every later
# gradient a little: measured 5 of k_proj's 512 values and 2 of v_proj's beyond fp32
# parity's bounds, by <= 4.2e-5 (a CI machine once saw more in k_proj). Allowed: 5e-4, 5%
# of one step's update; a wrong shard or an unreduced gradient moves weights by whole updates.
FOLLOWING_ATOL = 5e-4


def assert_weights_match(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and QUANTISED <= want.keys()
    for key in want:
        if key not in QUANTISED:
            close = torch.isclose(got[key], want[key], rtol=1e-4, atol=FOLLOWING_ATOL)
            assert close.all(), (key, (got[key] - want[key]).abs().max().item())
            continue
        diff = (got[key] - want[key]).abs()
        beyond = (diff > 1e-5 + 1e-4 * want[key].abs()).sum().item()
        assert beyond <= 0.01 * diff.numel() and diff.max() <= 2e-3, (key, beyond, diff.max())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("lowbit"), tiny_model_dir)


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """The module's 2-process runs, made together in one launch: the whole run ("two"), and
    a run stopped after step 4 then resumed with the whole run's config ("interrupted")."""
    runs = [("two", LOWBIT), ("interrupted", (*LOWBIT, "train.max_steps=4"))]
    outs = workspace.train_together([*runs, ("interrupted", LOWBIT)])
    assert "19 of 20 tensors keep full-precision moments" in workspace.outputs_together["two"]
    return outs


def test_two_processes_match_one(workspace, two_processes):
    one, two = workspace.train("one", *LOWBIT), two_processes["two"]
    for got, want in [(train_losses(two), train_losses(one)), (eval_losses(two), eval_losses(one))]:
        assert got.keys() == want.keys() and len(got) >= 1
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=REL), step
    assert_weights_match(*(load_file(d / "model.safetensors") for d in (two, one)))


def test_two_processes_resume_exactly(workspace, two_processes):
    """A 2-process run stopped after step 4 and resumed on 2 processes: steps 5 and 6, the
    last eval and the final weights equal the uninterrupted run's, bit for bit (the 8-bit
    moments' shards went through the checkpoint and back)."""
    resumed, whole = two_processes["interrupted"], two_processes["two"]
    output = workspace.outputs_together["interrupted"]
    assert "resumed from" in output and "step-00000004" in output
    assert train_losses(resumed) == train_losses(whole)
    assert eval_losses(resumed)[6] == eval_losses(whole)[6]
    got, want = (load_file(d / "model.safetensors") for d in (resumed, whole))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in want)
