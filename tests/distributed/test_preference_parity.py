"""Preference stages on 2 processes compute what 1 process computes, and never hang.

Field note 3: ORPO on two GPUs hung for 30 minutes because ranks gathered tensors of
different shapes (full logits with per-rank lengths; KTO's per-rank chosen/rejected
counts). Here the pairs have different lengths on each rank, the 11 pairs leave one rank
with filler on the last step of each epoch, and a KTO micro-batch may hold only undesirable
samples; every metric is still a fixed-order (sum, count) all-reduce, so every step's loss
and every metric must match the single-process run to 1e-5 relative (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from multiproc import PREFERENCE_PAIRS, Workspace, assert_same_last_eval_loss, step_records

from keel.stages.pairs import PAIR_METRICS as METRICS_OF_PAIRS

REL = 1e-5
BETA = 0.1  # dpo.beta (and kto.beta) of every run here (the default)


def pair_rows() -> list[dict]:
    return [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in PREFERENCE_PAIRS]


def kto_rows() -> list[dict]:
    """Good answers desirable, bad ones not; in an order that leaves some micro-batches
    with undesirable samples only."""
    rows = []
    for i, (q, good, bad) in enumerate(PREFERENCE_PAIRS):
        rows.append({"prompt": q, "completion": bad if i % 3 else good, "label": not i % 3})
    return rows


def assert_same_metrics(got: Path, want: Path, names: tuple[str, ...]) -> None:
    got_lines, want_lines = step_records(got), step_records(want)
    assert got_lines.keys() == want_lines.keys() and want_lines
    for step, want_line in want_lines.items():
        for name in names:
            if name not in want_line:
                assert name not in got_lines[step], (step, name)
                continue
            a, b = got_lines[step][name], want_line[name]
            if name == "rewards/accuracies" and _tied(want_line):
                continue  # every margin within round-off of 0: round-off breaks the ties
            # Rewards and margins are beta x differences of sequence log-probs: fp32 round-off
            # of the log-probs (not of the difference) sets their scale. The loss is a
            # function of those rewards with slope <= 1, so beta x the log-probs' scale
            # bounds it (full fine-tuning: the updates carry last step's round-off onward).
            scale = 0.0
            if name.startswith(("rewards/", "kl")):
                scale = _reward_scale(want_line)
            elif name == "loss":
                scale = BETA * _reward_scale(want_line)
            assert abs(a - b) <= REL * max(abs(b), scale, 1e-3), (step, name, a, b)


def _tied(line: dict) -> bool:
    """Whether a step's pairs are ties (the policy is its reference: full fine-tuning's
    first step), so that which reward is larger is round-off's choice: a precomputed
    reference and the policy sum a sequence's log-probs in other orders when its tokens are
    split over processes in other places (context parallelism)."""
    margin = abs(line.get("rewards/margins", 1.0))
    chosen = abs(line.get("rewards/chosen", 1.0))
    return margin <= REL * max(_reward_scale(line), 1e-3) and chosen <= REL * _reward_scale(line)


def _reward_scale(line: dict) -> float:
    logps = [abs(line[k]) for k in ("logps/chosen", "logps/rejected") if k in line]
    return max(logps, default=0.0)


class PreferenceWorkspace(Workspace):
    def __init__(self, root: Path, model_dir: Path):
        super().__init__(root, model_dir)
        (root / "pairs.json").write_text(json.dumps(pair_rows()))
        (root / "kto.json").write_text(json.dumps(kto_rows()))
        cfg = yaml.safe_load(self.config.read_text())
        cfg["data"] = {"datasets": [str(root / "pairs.json")], "cutoff_len": 128, "val_size": 1}
        cfg["train"]["stage"] = "dpo"
        self.config.write_text(yaml.safe_dump(cfg))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> PreferenceWorkspace:
    return PreferenceWorkspace(tmp_path_factory.mktemp("preference"), tiny_model_dir)


PAIR_METRICS = ("loss", *METRICS_OF_PAIRS)
KTO = ("train.stage=kto", "data.datasets.0.path=kto.json")


# case -> (stage, overrides, strategy, metrics compared)
CASES = {
    "dpo-ddp-packed": ("dpo", ("data.packing=true",), "ddp", PAIR_METRICS),
    "dpo-fsdp-ckpt": ("dpo", ("train.gradient_checkpointing=true",), "fsdp", PAIR_METRICS),
    "orpo-fsdp-full": (
        "orpo",
        ("method.type=full",),
        "fsdp",
        (*PAIR_METRICS, "nll_loss", "log_odds_ratio"),
    ),
    "simpo-ddp-packed": ("simpo", ("data.packing=true",), "ddp", PAIR_METRICS),
    "kto-fsdp-freeze-reference-copy": (
        "kto",
        (*KTO, "method.type=freeze", "method.freeze.trainable_layers=1"),
        "fsdp",
        ("loss", "kl", "rewards/chosen", "rewards/rejected"),
    ),
}
FULL = ("method.type=full",)
# The live reference of full fine-tuning is a frozen copy (sharded under FSDP), the
# precomputed one a pass before training split across ranks.
PRECOMPUTED = ("dpo-full-precompute", (*FULL, "dpo.reference=precompute"))


def _overrides(case: str) -> tuple[str, ...]:
    stage, extra, _strategy, _names = CASES[case]
    return (f"train.stage={stage}", *extra)


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """Every 2-process run of the module, made together in one launch: name -> output.dir."""
    runs = {
        f"{case}-two": (*_overrides(case), f"distributed.strategy={CASES[case][2]}")
        for case in CASES
    }
    runs[PRECOMPUTED[0]] = (*PRECOMPUTED[1], "distributed.strategy=fsdp")
    return workspace.train_together(runs.items())


@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one(workspace, two_processes, case):
    names = CASES[case][3]
    want = workspace.train(f"{case}-one", *_overrides(case))
    got = two_processes[f"{case}-two"]
    assert_same_metrics(got, want, (*names, "logps/chosen", "logps/rejected"))
    assert_same_last_eval_loss(got, want, REL)


def test_full_dpo_precomputed_reference_on_two_processes_matches_live_on_one(
    workspace, two_processes
):
    """Same losses with either reference. A resumed run uses the cache and continues
    exactly."""
    want = workspace.train("dpo-full-live", *FULL)
    got = two_processes[PRECOMPUTED[0]]
    assert "reference log-probs: one pass" in workspace.outputs_together[PRECOMPUTED[0]]
    assert_same_metrics(got, want, PAIR_METRICS)
    first = workspace.train("dpo-full-resumed", *PRECOMPUTED[1], "train.max_steps=4")
    assert "loaded from cache" in workspace.last_output
    resumed = workspace.train("dpo-full-resumed", *PRECOMPUTED[1])
    assert first == resumed and "resumed from" in workspace.last_output
    assert_same_metrics(resumed, want, PAIR_METRICS)


def test_dpo_first_step_is_ln2_with_lora(workspace):
    out = workspace.train("dpo-ln2", "train.max_steps=1", "train.global_batch_size=4")
    first = step_records(out)[1]
    assert first["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-7)
    assert first["pairs"] == 4
