"""What the pair stages (dpo, orpo, simpo) share: a row is a prompt with a chosen and a
rejected answer, in the same formats, reported under the same metric names (TRL's). One
module for these few shared facts; each stage's loss lives in its own module."""

from __future__ import annotations

PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# TRL's preference format, or LLaMA-Factory's ranking data in the chat formats
PAIR_FORMATS = ("preference", "alpaca", "sharegpt", "messages")


def label_smoothing_problems(value: float, key: str) -> list[str]:
    """The assumed label noise of dpo and simpo: a probability below one half."""
    return [] if 0 <= value < 0.5 else [f"{key} = {value} must be in [0, 0.5)"]
