"""A rollout's numbers over every rank: dapo's completion-token count and the step's reward
and length metrics, summed in ONE all-reduce of a fixed-layout vector (the same length on
every rank whatever its data, so the collective always matches)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from keel.distributed.process_group import DistContext
    from keel.rewards import RewardFunction

# (sum, sum of squares, count): what a global mean and (Bessel) std need
_MOMENTS = 3


@dataclass(kw_only=True)
class RolloutTally:
    """This rank's (or, after `all_reduced`, every rank's) rollout numbers."""

    target_tokens: float  # completion target tokens (what dapo normalises by)
    real_tokens: float  # input tokens of the rollout rows (prompt + completion)
    completions: float
    truncated: float  # completions that hit max_completion_length
    length_sum: float  # completion tokens sampled
    reward: tuple[float, float, float]  # moments of the weighted reward (scorable only)
    zero_std_groups: float
    groups: float
    functions: list[tuple[float, float, float]]  # moments of each reward function
    max_length: float  # the longest completion (max over ranks)
    generation_seconds: float  # the slowest rank's

    @classmethod
    def of(
        cls, scored, rows: list[dict], group: int, rewards: list[RewardFunction]
    ) -> RolloutTally:
        """This rank's numbers from its scored block (keel.train.rollout_rows.ScoredPrompts)."""
        lengths = [len(c.token_ids) for c in scored.completions]
        grouped = scored.rewards.view(-1, group) if lengths else torch.zeros(0, group)
        return cls(
            target_tokens=sum(row["num_targets"] for row in rows),
            real_tokens=sum(len(row["input_ids"]) for row in rows),
            completions=len(lengths),
            truncated=sum(c.finish_reason == "length" for c in scored.completions),
            length_sum=sum(lengths),
            reward=_moments(scored.rewards),
            zero_std_groups=float((_group_std(grouped) == 0).sum()),
            groups=grouped.shape[0],
            functions=[_moments(scored.scores[:, f]) for f in range(len(rewards))],
            max_length=max(lengths, default=0),
            generation_seconds=scored.seconds,
        )

    @classmethod
    def zero(cls, functions: int) -> RolloutTally:
        """Nothing to add (a process whose block another process counts)."""
        return cls(
            target_tokens=0.0, real_tokens=0.0, completions=0.0, truncated=0.0,
            length_sum=0.0, reward=(0.0, 0.0, 0.0), zero_std_groups=0.0, groups=0.0,
            functions=[(0.0, 0.0, 0.0)] * functions, max_length=0.0, generation_seconds=0.0,
        )  # fmt: skip

    def all_reduced(self, dist: DistContext) -> RolloutTally:
        """Every rank's tally summed (maxima for max_length and generation_seconds: each rank
        owns one slot of the vector): one all-reduce, the same length on every rank."""
        rank, size = dist.dp_rank, dist.dp_size
        slots = [0.0] * (2 * size)
        slots[rank], slots[size + rank] = self.max_length, self.generation_seconds
        head = [
            self.target_tokens,
            self.real_tokens,
            self.completions,
            self.truncated,
            self.length_sum,
            *self.reward,
            self.zero_std_groups,
            self.groups,
        ]
        flat = head + [x for moments in self.functions for x in moments] + slots
        total = dist.all_reduce_sum(flat)
        body = total[len(head) : len(head) + _MOMENTS * len(self.functions)]
        return RolloutTally(
            target_tokens=total[0],
            real_tokens=total[1],
            completions=total[2],
            truncated=total[3],
            length_sum=total[4],
            reward=tuple(total[5:8]),
            zero_std_groups=total[8],
            groups=total[9],
            functions=[tuple(body[i : i + _MOMENTS]) for i in range(0, len(body), _MOMENTS)],
            max_length=max(total[-2 * size : -size]),
            generation_seconds=max(total[-size:]),
        )


def rollout_metrics(totals: RolloutTally, names: list[str]) -> dict[str, float]:
    """The step's record entries (TRL's names) from the global tally."""
    metrics = {
        "reward": _mean(totals.reward),
        "reward_std": _std(totals.reward),
    }
    for name, moments in zip(names, totals.functions):
        metrics[f"rewards/{name}/mean"] = _mean(moments)
        metrics[f"rewards/{name}/std"] = _std(moments)
    completions = max(totals.completions, 1)
    metrics |= {
        "frac_reward_zero_std": totals.zero_std_groups / max(totals.groups, 1),
        "completions/mean_length": totals.length_sum / completions,
        "completions/max_length": totals.max_length,
        "completions/clipped_ratio": totals.truncated / completions,
        "generation_tokens_per_s": totals.length_sum / max(totals.generation_seconds, 1e-9),
        "generation_seconds": round(totals.generation_seconds, 4),
    }
    return metrics


def _moments(values: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, count) of the finite entries (NaN: unscorable)."""
    kept = values[~values.isnan()].double()
    return (kept.sum().item(), (kept * kept).sum().item(), float(kept.numel()))


def _mean(moments) -> float:
    total, _, count = moments
    return total / count if count else float("nan")


def _std(moments) -> float:
    """Bessel-corrected, as torch.std and TRL's logged reward_std."""
    total, squares, count = moments
    if count < 2:
        return float("nan")
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def _group_std(grouped: torch.Tensor) -> torch.Tensor:
    """Each group's std over its scorable rewards ([P, G] -> [P]); NaN rewards ignored."""
    stds = []
    for rewards in grouped:
        kept = rewards[~rewards.isnan()]
        stds.append(kept.std() if kept.numel() > 1 else torch.tensor(0.0))
    return torch.stack(stds) if stds else torch.zeros(0)
