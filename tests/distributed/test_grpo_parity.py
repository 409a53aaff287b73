"""grpo on 2 processes samples the completions 1 process samples, and computes its losses.

Sampling is seeded per (train.seed, step, prompt row, sample), never per rank, and each
rank generates whole units of its contiguous block of prompts: the rewards (functions of
the completions' text) must be EQUAL, and the losses and gradient norms equal to fp32
round-off. Under FSDP2 the weights are gathered once before generating (no collective per
token), under DDP generation runs on the unwrapped model; the completions' lengths differ
between ranks, which must not hang either. dapo over 2 ranks also checks the one all-reduce
of the completion-token count, dr_grpo with scale_rewards batch the all-reduce of the rewards
(the std is of the whole window's), and num_iterations 2 the old log-probs: also when a run stops
inside a rollout's 2 steps and resumes on 2 processes or on 1 (each process saved its block
of the rollout; a resumed process takes its share of their union).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import write_grpo_inputs
from multiproc import Workspace, case_runs, step_records

EXACT = ("reward", "reward_std", "completions/mean_length", "completions/max_length")
CLOSE = ("loss", "grad_norm", "clip_ratio/region_mean")


class GrpoWorkspace(Workspace):
    def __init__(self, root: Path, model_dir: Path):
        super().__init__(root, model_dir)
        write_grpo_inputs(root)
        cfg = yaml.safe_load(self.config.read_text())
        cfg["data"] = {"datasets": [str(root / "prompts.jsonl")], "cutoff_len": 64}
        cfg["train"] |= {"stage": "grpo", "global_batch_size": 4, "max_steps": 4}
        cfg["grpo"] = {
            "rewards": ["rewards.py:share_of_letter", "rewards.py:logs_letters"],
            "num_generations": 4,
            "max_completion_length": 6,
            "log_completions_every": 1,
        }
        self.config.write_text(yaml.safe_dump(cfg))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> GrpoWorkspace:
    return GrpoWorkspace(tmp_path_factory.mktemp("grpo"), tiny_model_dir)


CASES = {
    "fsdp-full-grpo": ("fsdp", ("method.type=full",)),
    "ddp-lora-dapo-reused": ("ddp", ("grpo.loss_type=dapo", "grpo.num_iterations=2")),
    # the window's reward std from every rank (one all-reduce) and dr_grpo's fixed divisor
    "fsdp-lora-dr_grpo-batch-scaled": (
        "fsdp",
        ("grpo.loss_type=dr_grpo", "grpo.scale_rewards=batch"),
    ),
}


# Stopped after step 3, inside the second rollout's 2 steps, on 2 processes; resumed to
# step 4 on (processes): compared with the uninterrupted 1-process run of the reused case
REUSED = "ddp-lora-dapo-reused"
RESUMED = {"dapo-resumed-on-2": 2, "dapo-resumed-on-1": 1}
STOPPED_INSIDE_A_ROLLOUT = ("train.max_steps=3",)


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    """Every case's 2-process run, made together in one launch: case -> output.dir; and
    the resumed runs' 2-process parts."""
    runs = case_runs(CASES)
    reused = dict(runs)[REUSED]
    for name, processes in RESUMED.items():
        runs.append((name, (*reused, *STOPPED_INSIDE_A_ROLLOUT)))
        if processes == 2:
            runs.append((name, reused))
    return workspace.train_together(runs)


@pytest.fixture(scope="module")
def one_process(workspace):
    """The 1-process run of each case (by case), made once for the module's tests."""
    runs: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in runs:
            runs[case] = workspace.train(f"{case}-one", *CASES[case][1])
        return runs[case]

    return run


@pytest.mark.parametrize("case", CASES)
def test_two_processes_sample_and_train_like_one(two_processes, one_process, case):
    want = one_process(case)
    got = two_processes[case]
    _assert_steps_match(got, want)
    # rank 0 logs its own prompts: the first half of each step's window
    logged = [json.loads(x) for x in (got / "completions.jsonl").read_text().splitlines()]
    alone = [json.loads(x) for x in (want / "completions.jsonl").read_text().splitlines()]
    for step in range(1, 5):
        two = [r["completion"] for r in logged if r["step"] == step]
        one = [r["completion"] for r in alone if r["step"] == step]
        assert len(two) == 2 * 4 and two == one[: len(two)]
    _assert_logged_like_one(got, want, logged, alone, reused="reused" in case)


def _assert_logged_like_one(got: Path, want: Path, logged: list, alone: list, reused: bool):
    """What the reward function logged (logs_letters): each completion's count in its
    sample record, and the mean of each call's mean count, averaged over both processes'
    calls (one each, of 8 completions), in the step record, as one process's one call;
    trainer_state's global_step of the rollout's step over max_steps, and whether it is
    process 0 (one of the 2 processes is)."""
    halves_differ = False
    for step, record in step_records(got).items():
        generated = (step - 1) - (step - 1) % (2 if reused else 1)  # a reused rollout's
        assert record["logged/progress"] == step_records(want)[step]["logged/progress"]
        assert record["logged/progress"] == generated / 4
        assert (record["logged/main"], step_records(want)[step]["logged/main"]) == (0.5, 1.0)
        counts = [r["extra"]["letters"] for r in alone if r["step"] == step]
        assert [r["completion"].count("a") for r in alone if r["step"] == step] == counts
        assert [r["extra"]["letters"] for r in logged if r["step"] == step] == counts[:8]
        mean = sum(counts) / len(counts)
        assert step_records(want)[step]["logged/letters"] == pytest.approx(mean, rel=1e-12)
        assert record["logged/letters"] == pytest.approx(mean, rel=1e-12)
        halves_differ |= sum(counts[:8]) != sum(counts[8:])
    assert halves_differ  # rank 0's own calls alone would not give the mean


def test_a_reward_function_may_not_log_a_metric_under_a_name_of_the_record(one_process):
    """keel refuses log_metric names its step record uses (reserved_metrics); every name a
    grpo record holds is among them, besides what the reward functions logged."""
    from keel.stages.registry import get_stage
    from keel.train.rollout_metrics import RolloutTally, rollout_metrics
    from keel.train.rollout_rewards import reserved_metrics

    names = ["rewards.py:share_of_letter", "rewards.py:logs_letters"]
    shorts = [name.split(":")[1] for name in names]
    own = rollout_metrics(RolloutTally.zero(2), shorts)
    reserved = reserved_metrics(list(own), list(get_stage("grpo").metric_names))
    for record in step_records(one_process("fsdp-full-grpo")).values():
        assert set(record) - reserved == {"logged/letters", "logged/progress", "logged/main"}


@pytest.mark.parametrize("name", RESUMED)
def test_a_resume_inside_a_rollout_trains_on_the_saved_rollout(
    workspace, two_processes, one_process, name
):
    """Step 4 trains on step 3's rollout, sampled by the weights of step 2: resumed from the
    step-3 checkpoint, on 2 processes or on 1, it matches the uninterrupted run (sampling
    it again from step 3's weights gives other completions and a ratio of 1)."""
    if RESUMED[name] == 1:
        resumed = workspace.train(name, *CASES[REUSED][1], "distributed.strategy=ddp")
        assert "resumed from" in workspace.last_output
    else:
        resumed = two_processes[name]
        assert "resumed from" in workspace.outputs_together[name]
    _assert_steps_match(resumed, one_process(REUSED))


def _assert_steps_match(got: Path, want: Path) -> None:
    mine, theirs = step_records(got), step_records(want)
    assert mine.keys() == theirs.keys() == {1, 2, 3, 4}
    for step, line in theirs.items():
        for name in EXACT:
            assert mine[step][name] == line[name], (step, name)
        for name in CLOSE:
            assert mine[step][name] == pytest.approx(line[name], rel=1e-5, abs=1e-7), (step, name)
