"""grpo: Group Relative Policy Optimization (and its Dr. GRPO and DAPO variants), online.

Each step the policy answers every prompt `num_generations` times; reward functions score
the completions, and each completion's advantage is its reward against its group's (the
same prompt's) mean (keel.losses.grpo.group_advantages). The loss is the clipped policy
gradient of PPO over the completion tokens (Shao et al. 2024, arXiv:2402.03300), normalised
per completion (grpo), by a constant (dr_grpo, Liu et al. 2025, arXiv:2503.20783) or per
token over the global batch (dapo, Yu et al. 2025, arXiv:2503.14476). Rollouts come from
keel.train.rollouts (a batch source); the objective is keel.train.grpo_objective.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from keel.stages.base import Stage, policy_gradient_objective, positive

# Fractions of completion tokens whose ratio was clipped: below 1 - epsilon with a negative
# advantage, above 1 + epsilon_high with a positive one, either (TRL's names). "kl" (the k3
# estimate against the reference) joins them when beta > 0, on the objective.
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# DAPO's clip-higher bound (Yu et al. 2025), the default epsilon_high of loss_type dapo
DAPO_EPSILON_HIGH = 0.28
# A reward spelled as a function: "file.py:function" or "package.module:function"
_FUNCTION_SPEC = re.compile(r"^(?:[^:]+\.py|[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*$")
VLLM_REASON = (
    "keel generates rollouts with its own engine (the one behind keel serve); a vLLM rollout "
    "backend needs vLLM and a CUDA GPU, and keel does not sync the policy's weights into "
    "vLLM yet; remove it or set generation_backend: keel"
)


@dataclass(kw_only=True)
class GrpoSettings:
    # Used with train.stage grpo. A row is a prompt: train.micro_batch_size and the global
    # batch count prompts; each is answered num_generations times.
    # Reward functions, summed with reward_weights: "file.py:function" (next to the
    # config), "package.module:function" (keel.rewards:format) or a reward model's folder
    rewards: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None  # one per reward; unset: all 1.0
    num_generations: int = 8  # completions per prompt (the group), >= 2
    max_completion_length: int = 256  # new tokens per completion at most
    temperature: float = 1.0  # sampling temperature; log-probs are taken at it too (as TRL)
    top_p: float = 1.0  # nucleus sampling: the smallest token set holding this probability
    # The loss's normaliser: grpo (per completion), dr_grpo (max_completion_length), dapo
    # (per token of the global batch, with clip-higher). TRL's default is dapo.
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    beta: float = 0.0  # KL penalty to the reference (k3 estimator); 0: no reference
    epsilon: float = 0.2  # the ratio is clipped below at 1 - epsilon
    # ... and above at 1 + epsilon_high; unset: 0.28 (clip-higher) for dapo, else epsilon
    epsilon_high: float | None = None
    num_iterations: int = 1  # policy updates per generated batch (the ratio moves when > 1)
    # Advantages are divided by the rewards' std within each group, over the batch, or not
    scale_rewards: Literal["group", "batch", "none"] = "group"
    mask_truncated_completions: bool = False  # completions cut at max_completion_length: no loss
    # Reference log-probs when beta > 0: live (LoRA: the base with adapters off; full/freeze:
    # a frozen copy sharded like the policy); auto: live
    reference: Literal["auto", "live"] = "auto"
    generation_backend: Literal["keel", "vllm"] = "keel"  # vllm: not available yet (says why)
    generation_batch_prompts: int = 1  # prompts generated together (same samples either way)
    log_completions_every: int = 10  # steps between samples in completions.jsonl; 0: never

    @property
    def clip_high(self) -> float:
        """The upper clipping bound's epsilon: epsilon_high, or DAPO's 0.28, or epsilon."""
        if self.epsilon_high is not None:
            return self.epsilon_high
        return DAPO_EPSILON_HIGH if self.loss_type == "dapo" else self.epsilon

    def problems(self, section: str) -> list[str]:
        """Rewards named and well spelled (not imported here), bounds of every number."""
        out = _reward_problems(self.rewards, self.reward_weights, section)
        out += _at_least(self.num_generations, 2, f"{section}.num_generations", "a group")
        out += _at_least(self.max_completion_length, 1, f"{section}.max_completion_length", "")
        out += positive(self.temperature, f"{section}.temperature")
        if not 0 < self.top_p <= 1:
            out.append(
                f"{section}.top_p = {self.top_p!r} must be in (0, 1]; 1.0 samples all tokens"
            )
        out += _not_negative(self.beta, f"{section}.beta", "0 trains without a reference")
        out += _not_negative(self.epsilon, f"{section}.epsilon", "0.2 is the usual value")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            out.append(
                f"{section}.epsilon_high = {self.epsilon_high!r} must be >= {section}.epsilon "
                f"({self.epsilon!r}); raise it, or remove it"
            )
        out += _at_least(self.num_iterations, 1, f"{section}.num_iterations", "")
        out += _at_least(
            self.generation_batch_prompts, 1, f"{section}.generation_batch_prompts", ""
        )
        if self.log_completions_every < 0:
            out.append(
                f"{section}.log_completions_every = {self.log_completions_every!r} must be "
                ">= 0; 0 writes no completions"
            )
        if self.generation_backend == "vllm":
            out.append(f"{section}.generation_backend = 'vllm': {VLLM_REASON}")
        return out


def _reward_problems(rewards: list[str], weights: list[float] | None, section: str) -> list[str]:
    if not rewards:
        return [
            f"{section}.rewards is empty: name at least one reward, e.g. "
            f"{section}.rewards: [keel.rewards:format] (file.py:function, "
            "package.module:function or a reward model's folder)"
        ]
    out = []
    for index, spec in enumerate(rewards):
        if not _reward_spelled(spec):
            out.append(
                f"{section}.rewards.{index} = {spec!r} is not a reward: write file.py:function, "
                "package.module:function (e.g. keel.rewards:format) or a reward model's folder"
            )
    if weights is not None and len(weights) != len(rewards):
        out.append(
            f"{section}.reward_weights has {len(weights)} value(s) for {len(rewards)} "
            f"reward(s): give one weight per reward, or remove it (all 1.0)"
        )
    return out


def _reward_spelled(spec: str) -> bool:
    """A function spec (one colon) or a folder path (a Windows drive's colon aside)."""
    spec = spec.strip()
    if not spec:
        return False
    if ":" not in re.sub(r"^[A-Za-z]:[\\/]", "", spec):
        return True  # a folder: whether it holds a reward model is known when it is loaded
    return bool(_FUNCTION_SPEC.match(spec))


def _at_least(value: int, low: int, key: str, why: str) -> list[str]:
    if value >= low:
        return []
    reason = f" ({why} needs {low})" if why else ""
    return [f"{key} = {value!r} must be >= {low}{reason}"]


def _not_negative(value: float, key: str, hint: str) -> list[str]:
    return [] if value >= 0 else [f"{key} = {value!r} must be >= 0; {hint}"]


def _needs_reference(settings: GrpoSettings) -> bool:
    """A reference model only for the KL term."""
    return settings.beta > 0


STAGE = Stage(
    name="grpo",
    summary="group relative policy optimization: online rollouts scored by reward functions",
    unit="prompt",
    sequences_per_row=1,
    uses_reference=True,
    reference_needed=_needs_reference,
    metric_names=CLIP_METRICS,
    formats=("prompt", "alpaca", "messages", "sharegpt"),
    objective=policy_gradient_objective,
    settings=GrpoSettings,
)
