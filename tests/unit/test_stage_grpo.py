"""The grpo stage record: its config section, its checks, its reference rule, its objective."""

from __future__ import annotations

import json

import pytest

from keel.config import load_config
from keel.distributed.process_group import DistContext
from keel.errors import ConfigError
from keel.precision import Precision
from keel.stages.base import reference_source
from keel.stages.grpo import CLIP_METRICS, DAPO_EPSILON_HIGH, GrpoSettings
from keel.stages.registry import get_stage
from keel.train.grpo_objective import PolicyGradientObjective
from keel.train.model_setup import build_training_model, reference_source_of

REWARDS = ["my_rewards.py:correct", "keel.rewards:format"]


def base(tmp_path, **grpo) -> dict:
    (tmp_path / "model").mkdir(exist_ok=True)
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(4))
    )
    return {
        "model": {"path": str(tmp_path / "model")},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "output": {"dir": str(tmp_path / "run")},
        "train": {"stage": "grpo", "global_batch_size": 2, "micro_batch_size": 1},
        "grpo": {"rewards": REWARDS, **grpo},
    }


def problems_of(tmp_path, overrides: list[str], **grpo) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, base=base(tmp_path, **grpo))
    return "\n".join(info.value.problems)


def test_the_issue_s_section_loads_from_yaml(tmp_path):
    """list[str] and list[float] | None are built from YAML by their field types."""
    config = tmp_path / "run.yaml"
    data = base(tmp_path)
    data["grpo"] |= {"reward_weights": [1, 0.2], "num_generations": 8, "temperature": 1.0}
    config.write_text(json.dumps(data))  # JSON is YAML
    cfg = load_config(config)
    settings = cfg.stage_settings
    assert isinstance(settings, GrpoSettings)
    assert settings.rewards == REWARDS and settings.reward_weights == [1.0, 0.2]
    assert settings.loss_type == "grpo" and settings.beta == 0.0 and settings.num_iterations == 1
    cfg = load_config(None, ["grpo.loss_type=dapo", "grpo.reward_weights=null"], base=data)
    assert cfg.stage_settings.loss_type == "dapo" and cfg.stage_settings.reward_weights is None


@pytest.mark.parametrize(
    "grpo,needle",
    [
        ({"rewards": []}, "grpo.rewards is empty: name at least one reward, e.g."),
        ({"rewards": ["my_rewards.py:"]}, "grpo.rewards.0 = 'my_rewards.py:' is not a reward"),
        (
            {"rewards": ["a b:c"]},
            "grpo.rewards.0 = 'a b:c' is not a reward: write file.py:function",
        ),
        ({"reward_weights": [1.0]}, "grpo.reward_weights has 1 value(s) for 2 reward(s)"),
        ({"num_generations": 1}, "grpo.num_generations = 1 must be >= 2"),
        ({"max_completion_length": 0}, "grpo.max_completion_length = 0 must be >= 1"),
        ({"temperature": 0}, "grpo.temperature = 0.0 must be > 0"),
        ({"top_p": 0}, "grpo.top_p = 0.0 must be in (0, 1]"),
        ({"top_p": 1.5}, "grpo.top_p = 1.5 must be in (0, 1]"),
        ({"beta": -0.1}, "grpo.beta = -0.1 must be >= 0"),
        ({"epsilon": -1}, "grpo.epsilon = -1.0 must be >= 0"),
        ({"epsilon_high": 0.1}, "grpo.epsilon_high = 0.1 must be >= grpo.epsilon (0.2)"),
        ({"num_iterations": 0}, "grpo.num_iterations = 0 must be >= 1"),
        ({"generation_batch_prompts": 0}, "grpo.generation_batch_prompts = 0 must be >= 1"),
        ({"log_completions_every": -1}, "grpo.log_completions_every = -1 must be >= 0"),
        ({"generation_backend": "vllm"}, "a vLLM rollout backend needs vLLM and a CUDA GPU"),
        ({"loss_type": "dapp"}, "did you mean 'dapo'?"),
        ({"reference": "precompute"}, "grpo.reference = 'precompute' is not one of auto, live"),
    ],
)
def test_bad_settings_are_refused_naming_key_value_and_fix(tmp_path, grpo, needle):
    assert needle in problems_of(tmp_path, [], **grpo)


def test_every_problem_is_reported_at_once():
    settings = GrpoSettings(rewards=[], num_generations=0, temperature=-1, top_p=2)
    assert len(settings.problems("grpo")) == 4


@pytest.mark.parametrize(
    "spec", ["my_rewards.py:correct", "rewards/x.py:f", "keel.rewards:format", "out/rm", "C:\\rm"]
)
def test_rewards_are_checked_by_spelling_only(spec):
    """Nothing is imported or opened here: the rollout source loads them (keel.rewards)."""
    assert GrpoSettings(rewards=[spec]).problems("grpo") == []


@pytest.mark.parametrize(
    "loss_type,epsilon_high,want",
    [
        ("grpo", None, 0.2),
        ("dr_grpo", None, 0.2),
        ("dapo", None, DAPO_EPSILON_HIGH),
        ("grpo", 0.3, 0.3),
    ],
)
def test_the_upper_clip_bound(loss_type, epsilon_high, want):
    settings = GrpoSettings(rewards=REWARDS, loss_type=loss_type, epsilon_high=epsilon_high)
    assert settings.clip_high == want


@pytest.mark.parametrize(
    "beta,lora,want",
    [(0.0, True, None), (0.0, False, None), (0.04, True, "adapters"), (0.04, False, "copy")],
)
def test_a_reference_only_for_the_kl_term(beta, lora, want):
    stage = get_stage("grpo")
    assert reference_source(stage, GrpoSettings(rewards=REWARDS, beta=beta), lora) == want


def test_the_record(tmp_path):
    stage = get_stage("grpo")
    assert stage.unit == "prompt" and stage.sequences_per_row == 1
    assert stage.metric_names == CLIP_METRICS
    assert set(stage.formats) == {"prompt", "alpaca", "messages", "sharegpt"}
    assert stage.settings is GrpoSettings


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_set_up_builds_the_policy_gradient_objective_and_its_reference_copy(
    tmp_path, tiny_model_dir, beta
):
    """Full fine-tuning with beta > 0: the frozen copy model set-up attaches is the
    objective's reference; beta 0 builds none (no second model in memory)."""
    overrides = [f"model.path={tiny_model_dir}", "method.type=full", f"grpo.beta={beta}"]
    cfg = load_config(None, overrides, base=base(tmp_path))
    built = build_training_model(
        cfg, tiny_model_dir, DistContext(), Precision("fp32", "test"), print
    )
    objective = built.objective
    assert isinstance(objective, PolicyGradientObjective)
    assert (objective.reference is not None) == (beta > 0)
    assert reference_source_of(cfg) == ("copy" if beta else None)
    assert objective.metric_names == CLIP_METRICS + (("kl",) if beta else ())
