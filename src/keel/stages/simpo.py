"""simpo: Simple Preference Optimization: length-normalised log-probs with a target reward
margin gamma, without a reference model. Log-probs are averaged per token (TRL's logps/*)."""

from __future__ import annotations

from dataclasses import dataclass

from keel.stages.base import Scored, Stage, positive, sequence_objective
from keel.stages.pairs import PAIR_FORMATS, PAIR_METRICS, label_smoothing_problems


@dataclass(kw_only=True)
class SimpoSettings:
    # Used with train.stage simpo (no reference model). A row is a pair:
    # train.micro_batch_size and the global batch count pairs.
    beta: float = 0.1  # the reward scale
    gamma: float = 0.5  # the target reward margin
    label_smoothing: float = 0.0  # assumed label noise, [0, 0.5)

    def problems(self, section: str) -> list[str]:
        """beta > 0; label_smoothing in [0, 0.5)."""
        out = positive(self.beta, f"{section}.beta")
        return out + label_smoothing_problems(self.label_smoothing, f"{section}.label_smoothing")


def pair_loss(policy: Scored, _reference, s):
    """(losses, chosen, rejected) of SimPO for pairs laid chosen, rejected, chosen, ..."""
    from keel.losses import preference as losses

    chosen, rejected = policy.means[0::2], policy.means[1::2]
    out = losses.simpo_loss(
        chosen,
        rejected,
        beta=s.beta,
        gamma=s.gamma,
        label_smoothing=s.label_smoothing,
    )
    return out, chosen, rejected


STAGE = Stage(
    name="simpo",
    summary="simple preference optimization on pairs, no reference model",
    unit="pair",
    sequences_per_row=2,
    uses_reference=False,
    metric_names=PAIR_METRICS,
    formats=PAIR_FORMATS,
    objective=sequence_objective,
    pair_loss=pair_loss,
    settings=SimpoSettings,
)
