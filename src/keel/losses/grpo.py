"""Group Relative Policy Optimization (GRPO) and its Dr. GRPO and DAPO variants, as pure
functions of per-token log-probabilities.

The three variants share the advantage (`group_advantages`) and the clipped per-token
surrogate (`policy_token_losses`); they differ only in how token losses become a loss
(`aggregate`) and so in the unit the trainer divides by (`loss_unit`):

    grpo    (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): the mean over a completion's
            tokens, averaged over completions.                      unit: completions
    dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783): the
            token sum over max_completion_length, averaged over completions, so a long
            completion is not diluted.                             unit: completions
    dapo    (Yu et al. 2025, DAPO, arXiv:2503.14476): the mean over every completion token
            of the global batch (token level; pairs with clip-higher). unit: completion tokens

keel's convention: `aggregate` returns a SUM over the micro-batch's units and the trainer
divides by the global batch's unit count, so two micro-batches (or ranks) give the loss of
one. The formulas match TRL 1.16's GRPOTrainer (tests/unit/test_losses_grpo.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "dr_grpo", "dapo"]
RewardScale = Literal["group", "batch", "none"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo")
REWARD_SCALES: tuple[str, ...] = ("group", "batch", "none")


def group_advantages(
    rewards: Tensor, group_size: int, *, scale: RewardScale = "group", eps: float = 1e-4
) -> Tensor:
    """Group-relative advantages of completions laid out group by group.

    rewards [N*G]: completions g*G .. g*G+G-1 are the G samples of prompt g; NaN marks a
    completion no reward function could score.

        A_i = (R_i - mean_group(R)) / (std + eps)

    std is Bessel-corrected (n - 1) and ignores NaNs, as TRL's `nanstd`; it is the group's
    ("group", DeepSeekMath), the whole tensor's ("batch": whatever the caller passes), or
    no division at all ("none", as Dr. GRPO recommends). eps is added to the std, not inside
    the root. A group of equal rewards gives A = 0; a NaN reward (or a group with a single
    scorable sample) gives A = 0. Returns [N*G] float32.
    """
    if scale not in REWARD_SCALES:
        raise ValueError(
            f"group_advantages: scale={scale!r} is not supported; choose one of "
            f"{', '.join(REWARD_SCALES)}."
        )
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: rewards of shape {tuple(rewards.shape)} are not whole groups "
            f"of {group_size}; pass a 1-D tensor of N*G rewards."
        )
    rewards = rewards.float()
    grouped = rewards.view(-1, group_size)  # [N, G]
    advantages = rewards - torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale == "group":
        advantages = advantages / (_nanstd(grouped, dim=1).repeat_interleave(group_size) + eps)
    elif scale == "batch":
        advantages = advantages / (_nanstd(rewards, dim=0) + eps)
    return torch.nan_to_num(advantages, nan=0.0)


def _nanstd(values: Tensor, *, dim: int) -> Tensor:
    """Bessel-corrected std over `dim` ignoring NaNs; NaN where fewer than two values count.
    The same operations in the same order as TRL's `nanstd`, so advantages match bit for bit."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    return torch.sqrt(variance * correction).squeeze(dim)


@dataclass(frozen=True)
class TokenLosses:
    """Per-token output of `policy_token_losses`; every tensor is [N], one per target token."""

    losses: Tensor  # [N] float32, carries the gradient
    low_clipped: Tensor  # [N] bool: ratio < 1 - epsilon_low and A < 0
    high_clipped: Tensor  # [N] bool: ratio > 1 + epsilon_high and A > 0
    kl: Tensor | None  # [N] detached k3 estimate of KL(policy || reference), when ref given


def policy_token_losses(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
) -> TokenLosses:
    """PPO's clipped surrogate per token (Schulman et al. 2017, arXiv:1707.06347), with an
    optional KL penalty to a reference policy, as GRPO uses it.

    All inputs are [N], flat over target tokens; `advantages` is each token's completion
    advantage. logps are log pi(o_t | q, o_<t) at the sampling temperature.

        ratio = exp(logps - old_logps)
        loss  = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
                + beta * kl,   kl = exp(ref - logps) - (ref - logps) - 1

    kl is Schulman's k3 estimator (http://joschu.net/blog/kl-approx.html): unbiased and >= 0.
    With one policy update per rollout old_logps = logps.detach(), so ratio == 1 and the
    value is -A (only its gradient carries signal). epsilon_high > epsilon_low is DAPO's
    clip-higher. Advantages, old and reference log-probs are constants here (detached).
    """
    shape = logps.shape
    inputs = (logps, old_logps, advantages) + (() if ref_logps is None else (ref_logps,))
    if logps.dim() != 1 or any(t.shape != shape for t in inputs):
        shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
        raise ValueError(f"policy_token_losses: inputs must be 1-D of equal length, got {shapes}.")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"policy_token_losses: beta={beta} needs ref_logps (or set beta 0).")
    logps = logps.float()
    advantages = advantages.detach().float()
    ratio = torch.exp(logps - old_logps.detach().float())  # [N]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if ref_logps is not None:
        delta = ref_logps.detach().float() - logps
        token_kl = torch.exp(delta) - delta - 1
        if beta != 0.0:
            losses = losses + beta * token_kl
        kl = token_kl.detach()
    ratio = ratio.detach()
    return TokenLosses(
        losses=losses,
        low_clipped=(ratio < 1 - epsilon_low) & (advantages < 0),
        high_clipped=(ratio > 1 + epsilon_high) & (advantages > 0),
        kl=kl,
    )


def aggregate(
    loss_type: LossType,
    losses: Tensor,
    sequence: Tensor,
    num_sequences: int,
    max_completion_length: int,
    counts: Tensor | None = None,
) -> Tensor:
    """The micro-batch's loss SUM over its units (see `loss_unit`); the trainer divides it by
    the global batch's unit count.

    losses [N] per target token, sequence [N] the completion (0 .. num_sequences-1) each
    token belongs to. A completion without target tokens (a truncated one under masking)
    still counts as a unit for grpo and dr_grpo, as in TRL. `counts` [S], each completion's
    target tokens, when `losses` hold only some of them (context parallelism: a process's
    part); by default they are counted from `sequence`.

        grpo:    sum_s (sum_{t in s} l_t / max(1, n_s))
        dr_grpo: sum_t l_t / max_completion_length    (the configured length, not the longest)
        dapo:    sum_t l_t
    """
    if loss_type == "grpo":
        sums = losses.new_zeros(num_sequences).index_add(0, sequence, losses)  # [S]
        if counts is None:
            counts = torch.bincount(sequence, minlength=num_sequences)  # [S]
        return (sums / counts.clamp(min=1)).sum()
    if loss_type == "dr_grpo":
        return losses.sum() / max_completion_length
    if loss_type == "dapo":
        return losses.sum()
    raise ValueError(f"aggregate: loss_type={loss_type!r}; choose one of {', '.join(LOSS_TYPES)}.")


def loss_unit(loss_type: LossType) -> Literal["completions", "completion_tokens"]:
    """What `aggregate`'s sum counts, i.e. what the trainer divides by: completions for grpo
    and dr_grpo, completion target tokens of the whole batch (every rank) for dapo."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_unit: loss_type={loss_type!r}; choose one of {', '.join(LOSS_TYPES)}."
        )
    return "completion_tokens" if loss_type == "dapo" else "completions"
