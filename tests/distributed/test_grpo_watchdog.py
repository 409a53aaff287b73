"""The watchdog over grpo's generation, weight gather and reward functions, 2 processes.

A rank stuck in a reward call or in the middle of generating is a hang: rank 0 goes on to
the step's one all-reduce and waits there (under FSDP2, when its peer never starts the
step's rollout, in the weight gather before generating); the watchdog must end the job
(exit 4) within hang_timeout_s + 30 s, name rank 1 and where it is stuck, with both ranks'
stacks. A rank that generates slowly but marks every engine round is not stuck, even when
its generation takes longer than hang_timeout_s in all and rank 0 waits for it that long.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from multiproc import _env, step_records
from test_grpo_parity import GrpoWorkspace
from test_watchdog import DEADLINE_S, HANG_TIMEOUT_S, finish, report, wait_for_step

STUCK = """
import os, time

def stuck_on_rank_1(completions, trainer_state, **kwargs):
    if os.environ.get("RANK") == "1" and trainer_state.global_step >= 1:
        time.sleep(3600)
    return [0.0 for _ in completions]
"""


def start(
    workspace: GrpoWorkspace, out: str, fault: str | None, *overrides: str, strategy: str = "ddp"
) -> subprocess.Popen:
    """`keel train` on 2 processes under the watchdog, into output.dir `out`; KEEL_FAULT set
    to `fault` unless None."""
    args = workspace.command(
        out,
        f"watchdog.hang_timeout_s={HANG_TIMEOUT_S}",
        f"distributed.strategy={strategy}",
        *overrides,
        "--nproc",
        "2",
    )
    env = _env() | ({"KEEL_FAULT": fault} if fault is not None else {})
    return subprocess.Popen(
        args, cwd=workspace.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def hang_report_after_step_1(proc: subprocess.Popen, out: Path) -> str:
    """Once step 1 is logged, the watchdog must end the job (its exit code 4, not
    torchrun's 1) within DEADLINE_S; the text of its hang report."""
    wait_for_step(out, 1, proc)
    code, output, seconds = finish(proc, time.monotonic())
    assert code == 4, output[-4000:]
    assert seconds < DEADLINE_S, seconds
    return report(out)


def both_stacks(out: Path) -> dict[int, str]:
    """rank -> the stacks the watchdog wrote for it."""
    return {r: (out / f"diagnostics/rank-{r:05d}-stacks.txt").read_text() for r in (0, 1)}


def test_a_reward_function_stuck_on_one_rank_is_reported(tmp_path, tiny_model_dir):
    workspace = GrpoWorkspace(tmp_path, tiny_model_dir)
    (tmp_path / "rewards.py").write_text(STUCK)
    overrides = ("grpo.rewards=[rewards.py:stuck_on_rank_1]", "train.max_steps=20")
    proc = start(workspace, "stuck", None, *overrides)  # no fault: the reward itself hangs
    out = tmp_path / "stuck"
    text = hang_report_after_step_1(proc, out)
    assert "behind the others: rank(s) 1" in text, text
    assert "reward rewards.py:stuck_on_rank_1" in text, text
    stacks = (out / "diagnostics/rank-00001-stacks.txt").read_text()
    assert "stuck_on_rank_1" in stacks and "score_rewards" in stacks


def test_a_rank_hung_while_generating_is_reported(tmp_path, tiny_model_dir):
    workspace = GrpoWorkspace(tmp_path, tiny_model_dir)
    proc = start(workspace, "hung", "hang_generation:2:1", "train.max_steps=20")
    out = tmp_path / "hung"
    text = hang_report_after_step_1(proc, out)
    assert "made no progress" in text and "behind the others: rank(s) 1" in text, text
    assert "at step 2: generation round" in text.split("rank 1 (alive", 1)[1], text
    stacks = both_stacks(out)
    assert "after_generation_round" in stacks[1] and "generate_groups" in stacks[1]
    assert "generate_groups" not in stacks[0]  # rank 0 is done generating: it waits


def test_a_rank_waiting_in_the_weight_gather_is_reported(tmp_path, tiny_model_dir):
    """FSDP2: rank 1 hangs at the start of step 2, before its rollout; rank 0 enters the
    weight gather that precedes generation and waits there for it (at keel's barrier that
    opens the gather). The watchdog ends the job, names rank 1 as behind and rank 0 as stuck
    in phase 'weight gather', with both stacks. Either rank may raise the alarm: both are
    idle past the limit, and which one's watchdog looks first depends on the machine's load."""
    workspace = GrpoWorkspace(tmp_path, tiny_model_dir)
    overrides = ("train.max_steps=20", "method.type=full")
    proc = start(workspace, "gather", "hang:2:1", *overrides, strategy="fsdp")
    out = tmp_path / "gather"
    text = hang_report_after_step_1(proc, out)
    assert "made no progress" in text and "behind the others: rank(s) 1" in text, text
    rank_0 = text.split("rank 0 (alive", 1)[1].split("rank 1 (alive", 1)[0]
    assert "at step 2: collective" in rank_0 and "barrier" in rank_0, text  # the gather's
    assert "phase 'weight gather'" in rank_0, text
    assert "rank 1: not reached (still at step 2: step begin)" in text, text
    stacks = both_stacks(out)
    assert "generation_ready" in stacks[0] and "generate_groups" not in stacks[0]
    assert "at_step_start" in stacks[1] and "generation_ready" not in stacks[1]


def test_slow_generation_is_progress_not_a_hang(tmp_path, tiny_model_dir):
    """Rank 1 sleeps after every engine round of step 2: its generation takes longer than
    hang_timeout_s, rank 0 waits for it that long, and the run ends normally."""
    workspace = GrpoWorkspace(tmp_path, tiny_model_dir)
    proc = start(workspace, "slow", "slow_generation:2:1:0.8", "train.max_steps=3")
    code, output, _ = finish(proc, time.monotonic())
    out = tmp_path / "slow"
    assert code == 0, output[-4000:]
    assert not (out / "diagnostics").exists(), output[-4000:]
    steps = step_records(out)
    assert steps.keys() == {1, 2, 3}
    assert steps[2]["generation_seconds"] > HANG_TIMEOUT_S  # the slowest rank's
    assert steps[1]["generation_seconds"] < HANG_TIMEOUT_S / 2
    assert json.loads((out / "keel_run.json").read_text())["steps"] == 3
