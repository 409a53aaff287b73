"""Reward functions of the GRPO demo (examples/grpo_sums.yaml): one-digit sums.

TRL's reward-function signature, so the file works unchanged with TRL's GRPOTrainer: keyword
arguments `prompts`, `completions` (text, or a list holding one assistant message for
conversational prompts) and every other dataset column (`answer`), one value per completion;
the function returns one float per completion.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def completion_text(completion) -> str:
    """The completion's text: TRL hands conversational completions as [{"role", "content"}]."""
    if isinstance(completion, list):
        return completion[-1]["content"]
    return completion


def correct(completions, answer, **kwargs) -> list[float]:
    """1.0 when the LAST number in the completion is the answer, else 0.0.

    "3 + 4 = 7." and "The answer is 7" score 1; a reply that wanders off and is cut at
    max_completion_length rarely ends on the right number, so the reward also favours
    replies that finish.
    """
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = NUMBER.findall(completion_text(completion))
        scores.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return scores
