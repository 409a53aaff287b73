"""`keel train` with train.stage grpo on the tiny random model: a user's reward file next to
the config, rollouts from keel's engine, metrics and sample completions, a policy that
learns what the reward asks for, and a resume that continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import keel_in_process
from conftest import GRPO_PROMPTS, write_grpo_inputs

CONFIG = """
model: {{path: {model}}}
method: {{type: full}}
data:
  datasets: [{{path: prompts.jsonl}}]
  cutoff_len: 64
train:
  stage: grpo
  global_batch_size: 4
  micro_batch_size: 2
  max_steps: {steps}
  lr: 1.0e-2
  scheduler: constant
  precision: fp32
  threads: 1
  seed: 3
grpo:
  rewards: [rewards.py:share_of_letter]
  num_generations: 8
  max_completion_length: 8
  log_completions_every: {every}
output:
  dir: out
  log_every: 1
  save_every: 2
  overwrite: {overwrite}
"""


def write_run(folder: Path, model: Path, *, steps: int, every: int = 5, overwrite=True) -> Path:
    """A run folder as a user has it: the config, the prompts and the reward file."""
    folder.mkdir(exist_ok=True)
    write_grpo_inputs(folder)
    config = CONFIG.format(model=model, steps=steps, every=every, overwrite=str(overwrite).lower())
    (folder / "grpo.yaml").write_text(config)
    return folder


def train(folder: Path, *overrides: str) -> list[dict]:
    result = keel_in_process("train", "grpo.yaml", *overrides, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_grpo_learns_what_the_reward_asks_for(tiny_model_dir, tmp_path):
    records = train(write_run(tmp_path, tiny_model_dir, steps=20))
    assert [r["step"] for r in records] == list(range(1, 21))
    name = "rewards/share_of_letter"  # TRL names a reward after its function
    for key in (
        "reward", "reward_std", f"{name}/mean", f"{name}/std", "frac_reward_zero_std",
        "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
        "generation_tokens_per_s", "training_tokens_per_s", "clip_ratio/region_mean",
    ):  # fmt: skip
        assert key in records[0], key
    assert records[0]["completions/max_length"] <= 8
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # measured: 0.04 -> 0.13 (the random model emits "a" in ~4% of its characters)
    assert last > first + 0.04, rewards
    samples = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
    assert {s["step"] for s in samples} == {5, 10, 15, 20}
    assert len(samples) == 4 * 4 * 8  # every 5 steps: 4 prompts x 8 completions
    assert samples[0]["prompt"] in GRPO_PROMPTS and "share_of_letter" in samples[0]["rewards"]


@pytest.mark.parametrize("method", ["full", "lora"])
def test_beta_trains_against_the_reference_and_logs_the_kl(tiny_model_dir, tmp_path, method):
    """grpo.beta > 0 takes a reference (full: a frozen copy of the start; LoRA: the policy
    with its adapters off) and logs `kl`: 0 at step 1, where the policy is the reference,
    then > 0 once the updates have moved it."""
    run = write_run(tmp_path, tiny_model_dir, steps=3)
    records = train(run, "grpo.beta=0.1", f"method.type={method}")
    kl = [r["kl"] for r in records]
    assert kl[0] == pytest.approx(0.0, abs=1e-6), kl
    assert min(kl[1:]) > 1e-6, kl


@pytest.fixture(scope="module")
def whole_runs(tiny_model_dir, tmp_path_factory):
    """`run(override) -> metrics records` of the uninterrupted 4-step run, made once each."""
    made: dict[str, list[dict]] = {}

    def run(override: str) -> list[dict]:
        if override not in made:
            folder = tmp_path_factory.mktemp("whole")
            made[override] = train(write_run(folder, tiny_model_dir, steps=4, every=1), override)
        return made[override]

    return run


@pytest.mark.parametrize(
    ("num_iterations", "first_steps"),
    [(1, 2), (2, 2), (2, 3), (3, 2)],
    ids=["mu1", "mu2-at-span-end", "mu2-inside-span", "mu3-inside-span"],
)
def test_resume_continues_exactly(
    tiny_model_dir, tmp_path, whole_runs, num_iterations, first_steps
):
    """4 steps in one run == `first_steps` steps, then a resumed run to 4: the same rollouts
    (rewards), losses and gradients, and completions.jsonl without a repeated step. A
    checkpoint inside a rollout's num_iterations steps holds the rollout, so the resumed
    run trains on it rather than sampling it again from weights that did not make it."""
    mu = f"grpo.num_iterations={num_iterations}"
    whole = whole_runs(mu)
    parts = write_run(tmp_path / "parts", tiny_model_dir, steps=first_steps, every=1)
    train(parts, mu)
    write_run(parts, tiny_model_dir, steps=4, every=1, overwrite=False)
    resumed = train(parts, mu)
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        assert [r[key] for r in resumed] == [r[key] for r in whole], key
    steps = [json.loads(line)["step"] for line in (parts / "out" / "completions.jsonl").open()]
    assert steps == sorted(steps) and set(steps) == {1, 2, 3, 4} and len(steps) == 4 * 4 * 8


def test_what_grpo_cannot_train_with_is_refused_at_once(tiny_model_dir, tmp_path):
    """An eval split, num_iterations without train.max_steps, a reward file without the
    function: every problem in one exit-2 report, before any model. (Saves inside a
    rollout's num_iterations steps are fine: the checkpoint holds the rollout.)"""
    folder = write_run(tmp_path, tiny_model_dir, steps=2)
    result = keel_in_process(
        "train",
        "grpo.yaml",
        "data.val_size=0.25",
        "grpo.rewards=[rewards.py:share_of_letter,rewards.py:missing]",
        "grpo.num_iterations=2",
        "train.max_steps=null",
        "output.save_every=3",
        cwd=folder,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "data.val_size = 0.25: grpo has no eval loss" in result.stderr
    assert "grpo.num_iterations = 2 needs train.max_steps" in result.stderr
    assert "output.save_every" not in result.stderr
    assert "grpo.rewards.1 = 'rewards.py:missing'" in result.stderr
    assert not (folder / "out" / "metrics.jsonl").exists()
    held_out = keel_in_process(
        "train", "grpo.yaml", "data.eval_datasets=[prompts.jsonl]", cwd=folder
    )
    assert (
        held_out.returncode == 2 and "data.eval_datasets: grpo has no eval loss" in held_out.stderr
    )


def test_a_preemption_inside_a_rollout_saves_it_and_the_same_command_resumes_exactly(
    tiny_model_dir, tmp_path, whole_runs, monkeypatch
):
    """SIGUSR1 (train.preempt_signal) after step 3, the first of the second rollout's 2
    steps: the preemption checkpoint holds the rollout, and the same command then trains
    step 4 on it, as the uninterrupted run did."""
    import os
    import signal

    from keel.checkpoint.layout import PROCESS_DIR, complete_checkpoints
    from keel.config import load_config
    from keel.errors import Preempted
    from keel.train.run import run_training

    previous = signal.signal(signal.SIGUSR1, lambda _n, _f: None)  # never pytest's end
    try:
        folder = write_run(tmp_path / "preempted", tiny_model_dir, steps=4, every=1)
        monkeypatch.chdir(folder)
        overrides = ["grpo.num_iterations=2", "train.preempt_signal=SIGUSR1"]
        cfg = load_config(folder / "grpo.yaml", overrides)

        def signal_after_3(step, _record):
            if step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

        with pytest.raises(Preempted, match="SIGUSR1.*finished step 3"):
            run_training(cfg, base_dir=folder, log=lambda _m: None, on_step_end=signal_after_3)
        (saved,) = [p for p in complete_checkpoints(folder / "out") if p.name.endswith("3")]
        assert (saved / PROCESS_DIR / "rank-00000.json").is_file()
        run_training(load_config(folder / "grpo.yaml", overrides), base_dir=folder, log=print)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    resumed = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").open()]
    whole = whole_runs("grpo.num_iterations=2")
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        assert [r[key] for r in resumed] == [r[key] for r in whole], key
