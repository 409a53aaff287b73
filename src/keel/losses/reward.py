"""Reward-model loss: Bradley-Terry on scalar scores of chosen and rejected completions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RewardPairLosses:
    """Per-pair output of `bradley_terry_loss`; every tensor is [P]."""

    losses: Tensor  # [P] per-pair loss; the trainer sums and divides by the global pair count
    accuracy: Tensor  # [P] float, detached: 1.0 where chosen scores above rejected
    margin: Tensor  # [P] detached: chosen - rejected (the scores' gap, TRL's `margin` metric)


def bradley_terry_loss(
    chosen: Tensor,
    rejected: Tensor,
    *,
    margin: Tensor | None = None,
    center_coefficient: float = 0.0,
) -> RewardPairLosses:
    """Bradley-Terry pairwise loss on reward-model scores (Bradley & Terry 1952; as trained
    in InstructGPT, Ouyang et al. 2022, arXiv:2203.02155).

    chosen, rejected [P]: the scalar scores r(x, y_chosen) and r(x, y_rejected).

        loss = -logsigmoid(chosen - rejected - margin) + c * (chosen + rejected)^2

    margin [P] (optional, per pair): how much better chosen must score (Llama 2, Touvron et
    al. 2023, arXiv:2307.09288). c = center_coefficient pulls scores toward zero mean
    (Eisenstein et al. 2023, "Helping or Herding?", arXiv:2312.09244). Per pair, so the sum
    over the global batch divided by its pair count equals TRL's RewardTrainer loss.
    """
    if chosen.dim() != 1 or chosen.shape != rejected.shape:
        raise ValueError(
            "bradley_terry_loss: chosen and rejected must be 1-D of equal length, got "
            f"{tuple(chosen.shape)} and {tuple(rejected.shape)}."
        )
    if margin is not None and margin.shape != chosen.shape:
        raise ValueError(
            f"bradley_terry_loss: margin of shape {tuple(margin.shape)} must match the "
            f"{chosen.shape[0]} pairs."
        )
    if not (math.isfinite(center_coefficient) and center_coefficient >= 0):
        raise ValueError(
            f"bradley_terry_loss: center_coefficient={center_coefficient} must be a finite "
            "number >= 0 (e.g. 0.01; 0 turns centering off)."
        )
    chosen, rejected = chosen.float(), rejected.float()
    gap = chosen - rejected  # [P]
    target_gap = gap if margin is None else gap - margin.detach().float()
    losses = -F.logsigmoid(target_gap)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    gap = gap.detach()
    return RewardPairLosses(losses=losses, accuracy=(gap > 0).float(), margin=gap)
