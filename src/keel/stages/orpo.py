"""orpo: Odds Ratio Preference Optimization: SFT on the chosen answer plus an odds-ratio
term, without a reference model. Log-probs are averaged per token (TRL's logps/*)."""

from __future__ import annotations

from dataclasses import dataclass

from keel.stages.base import Scored, Stage, positive, sequence_objective
from keel.stages.pairs import PAIR_FORMATS, PAIR_METRICS

ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


@dataclass(kw_only=True)
class OrpoSettings:
    # Used with train.stage orpo (no reference model). A row is a pair: train.micro_batch_size
    # and the global batch count pairs.
    beta: float = 0.1  # the paper's lambda: the weight of the odds-ratio term beside the SFT loss

    def problems(self, section: str) -> list[str]:
        """beta > 0."""
        return positive(self.beta, f"{section}.beta")


def pair_loss(policy: Scored, _reference, s):
    """(losses, chosen, rejected) of ORPO for pairs laid chosen, rejected, chosen, ..."""
    from keel.losses import preference as losses

    chosen, rejected = policy.means[0::2], policy.means[1::2]
    return losses.orpo_loss(chosen, rejected, beta=s.beta), chosen, rejected


STAGE = Stage(
    name="orpo",
    summary="odds ratio preference optimization on pairs, no reference model",
    unit="pair",
    sequences_per_row=2,
    uses_reference=False,
    metric_names=PAIR_METRICS + ORPO_METRICS,
    formats=PAIR_FORMATS,
    objective=sequence_objective,
    pair_loss=pair_loss,
    settings=OrpoSettings,
)
