"""A reward model (train.stage rm) on 2 processes trains what 1 process trains, and exports it.

The score head is a submodule of the objective: seeded from train.seed (the same on every
rank), a DDP bucket under DDP, part of the FSDP2 root unit (sharded) under FSDP2. Each step's
loss and its accuracy/margin/reward metrics must match the single-process run to 1e-5
relative (fp32); the 11 pairs leave one rank with filler on the last step of each epoch, and
the pairs carry a `margin` column. The exported *ForSequenceClassification folder (under
FSDP2: the head gathered from its shards, the backbone from its shards) must score texts as
the single-process folder does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from multiproc import (
    PREFERENCE_PAIRS,
    Workspace,
    assert_same_last_eval_loss,
    single_process_runs,
    step_records,
)

from keel.stages.rm import RM_METRICS
from keel.train.reward_objective import head_initial_value

REL = 1e-5
# texts the exported classifiers score (different lengths: the padded batch reads each
# sequence's score at its own last token)
SCORED = ["Who are you? I am Keel.", "Blue.", "What is 3 times 4? 12, I think, or maybe 34."]


class RewardWorkspace(Workspace):
    def __init__(self, root: Path, model_dir: Path):
        super().__init__(root, model_dir)
        rows = [
            {"prompt": q, "chosen": c, "rejected": r, "margin": 0.25 * (i % 3)}
            for i, (q, c, r) in enumerate(PREFERENCE_PAIRS)
        ]
        (root / "pairs.json").write_text(json.dumps(rows))
        cfg = yaml.safe_load(self.config.read_text())
        cfg["data"] = {"datasets": [str(root / "pairs.json")], "cutoff_len": 128, "val_size": 1}
        cfg["train"] |= {"stage": "rm", "max_steps": 4, "seed": 5}
        cfg["rm"] = {"center_rewards_coefficient": 0.01}
        self.config.write_text(yaml.safe_dump(cfg))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> RewardWorkspace:
    return RewardWorkspace(tmp_path_factory.mktemp("rm"), tiny_model_dir)


@pytest.fixture(scope="module")
def reference(workspace):
    """Single-process runs, one per distinct config (DDP and FSDP2 LoRA share one)."""
    return single_process_runs(workspace)


def assert_same_metrics(got: Path, want: Path) -> None:
    got_lines, want_lines = step_records(got), step_records(want)
    assert got_lines.keys() == want_lines.keys() == {1, 2, 3, 4}
    for step, want_line in want_lines.items():
        assert got_lines[step]["pairs"] == want_line["pairs"], step
        assert got_lines[step]["accuracy"] == want_line["accuracy"], step
        # the scores' round-off sets the scale of their differences and means (a margin
        # or mean near zero is still only as exact as the scores themselves)
        scale = max(abs(want_line[k]) for k in ("chosen_reward", "rejected_reward"))
        for name in ("loss", "grad_norm", *RM_METRICS):
            a, b = got_lines[step][name], want_line[name]
            assert abs(a - b) <= REL * max(abs(b), scale, 1e-3), (step, name, a, b)


def classifier_scores(out: Path, tokenizer_dir: Path) -> tuple[torch.Tensor, dict]:
    """The exported folder's scores of SCORED (one padded batch) and its weights."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    classifier = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    batch = tokenizer(SCORED, return_tensors="pt", padding=True)
    with torch.no_grad():
        return classifier(**batch).logits[:, 0], classifier.state_dict()


# Full fine-tuning at a full fine-tuning learning rate: at LoRA's 1e-2, Adam's first steps
# (updates of about lr x sign(gradient)) turn gradient round-off of the summation order into
# score differences of 1e-4 relative by step 3; the losses stay within 1e-5 either way.
# FSDP2 + LoRA exports through another path: the adapter gathered from its shards is merged
# into a base rebuilt on CPU.
CASES = {
    "ddp-lora": ("ddp", ("method.type=lora",)),
    "fsdp-full": ("fsdp", ("method.type=full", "train.lr=1e-3")),
    "fsdp-lora": ("fsdp", ("method.type=lora",)),
}


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """Every case's 2-process run, made together in one launch: case -> output.dir."""
    return workspace.train_cases_together(CASES)


@pytest.mark.parametrize("case", CASES)
def test_two_processes_train_and_export_like_one(
    workspace, reference, two_processes, tiny_model_dir, case
):
    from transformers import AutoConfig

    strategy, overrides = CASES[case]
    want = reference(*overrides)
    got = two_processes[case]
    summary = json.loads((got / "keel_run.json").read_text())
    assert summary["processes"] == 2 and summary["strategy"] == strategy
    assert_same_metrics(got, want)
    assert_same_last_eval_loss(got, want, REL)

    got_scores, got_weights = classifier_scores(got, tiny_model_dir)
    want_scores, want_weights = classifier_scores(want, tiny_model_dir)
    # the exported head is the trained one, not its seeded initial value
    head = want_weights["score.weight"]
    std = AutoConfig.from_pretrained(str(tiny_model_dir)).initializer_range
    assert not torch.allclose(head, head_initial_value(head.shape, std, seed=5), atol=1e-4)
    assert got_weights.keys() == want_weights.keys()
    for key, value in want_weights.items():
        torch.testing.assert_close(got_weights[key], value, rtol=1e-4, atol=1e-5, msg=key)
    torch.testing.assert_close(got_scores, want_scores, rtol=1e-4, atol=1e-5)
