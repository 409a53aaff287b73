"""Rewards for online RL (train.stage: grpo): load them from a config, score completions.

A reward is a function with TRL's signature (so existing reward files work unchanged), a
built-in (`keel.rewards:format`, `keel.rewards:exact_match`), or a reward model's folder.
docs/rewards.md is the manual. Nothing here imports keel.train, keel.data or keel.cli.
"""

from keel.rewards.loading import RewardFunction, load_rewards
from keel.rewards.reward_log import RewardLog, RewardLogError
from keel.rewards.scoring import (
    RewardError,
    RewardInputs,
    TrainerState,
    score_rewards,
    weighted_rewards,
)
from keel.rewards.text import exact_match, format

__all__ = [
    "RewardError",
    "RewardFunction",
    "RewardInputs",
    "RewardLog",
    "RewardLogError",
    "TrainerState",
    "exact_match",
    "format",
    "load_rewards",
    "score_rewards",
    "weighted_rewards",
]
