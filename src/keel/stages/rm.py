"""rm: a reward model: a scalar score head on the language model's last hidden state,
trained with the Bradley-Terry loss on the pairs DPO trains on (TRL's RewardTrainer).

A pair's chosen and rejected answers are scored by the backbone's hidden state at each
sequence's last token (where transformers' *ForSequenceClassification reads it), through a `score` Linear
(hidden -> 1, no bias) that trains under every method, LoRA included. An optional `margin`
column (TRL's name) asks chosen to score at least that much higher. The output folder is a
`*ForSequenceClassification` model (keel.models.sequence_classifier) that a grpo run can
name as a reward. The objective is keel.train.reward_objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keel.stages.base import Objective, ObjectiveKit, Stage
from keel.stages.pairs import PAIR_FORMATS

# TRL's names (RewardTrainer): the share of pairs whose chosen answer scores higher, the
# mean score gap chosen - rejected, the mean score of every answer; then each side's mean
RM_METRICS = ("accuracy", "margin", "mean_reward", "chosen_reward", "rejected_reward")


@dataclass(kw_only=True)
class RmSettings:
    # Used with train.stage rm. A row is a pair: train.micro_batch_size and the global batch
    # count pairs. A dataset may add a numeric `margin` column: how much higher chosen must
    # score (Llama 2's margin loss).
    # Weight of (chosen + rejected)^2, which pulls scores toward zero mean (Eisenstein et al.
    # 2023); 0 turns it off, TRL suggests 0.01
    center_rewards_coefficient: float = 0.0

    def problems(self, section: str) -> list[str]:
        """center_rewards_coefficient is a finite number >= 0."""
        value = self.center_rewards_coefficient
        if math.isfinite(value) and value >= 0:
            return []
        key = f"{section}.center_rewards_coefficient"
        return [f"{key} = {value!r} must be a finite number >= 0 (e.g. 0.01; 0 turns it off)"]


def reward_objective(kit: ObjectiveKit, stage: Stage) -> Objective:
    """The objective factory of rm: per-sequence scores from the head, then Bradley-Terry."""
    return kit.reward_scores(stage)


STAGE = Stage(
    name="rm",
    summary="reward model: a scalar score head trained on pairs (Bradley-Terry)",
    unit="pair",
    sequences_per_row=2,
    uses_reference=False,
    metric_names=RM_METRICS,
    formats=PAIR_FORMATS,
    objective=reward_objective,
    settings=RmSettings,
    head="score",
)
