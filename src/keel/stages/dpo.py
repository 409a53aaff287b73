"""dpo: Direct Preference Optimization on pairs, against a frozen reference model.

Log-probs are summed over each answer's tokens (TRL's logps/*); the ipo loss works on
length-normalised log-ratios instead (IPO, Azar et al. 2023, as TRL computes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from keel.stages.base import ReferenceSetting, Scored, Stage, positive, sequence_objective
from keel.stages.pairs import PAIR_FORMATS, PAIR_METRICS, label_smoothing_problems


@dataclass(kw_only=True)
class DpoSettings:
    # Used with train.stage dpo. A row is a pair: train.micro_batch_size and the global
    # batch count pairs.
    beta: float = 0.1  # KL strength: how far the policy may move from the reference
    # The loss: sigmoid (the paper), robust (noise-robust with label_smoothing), ipo
    # (length-normalised log-ratios), hinge (SLiC)
    loss_type: Literal["sigmoid", "robust", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = 0.0  # sigmoid and robust: assumed label noise, [0, 0.5)
    # Reference log-probs: live (LoRA: the base with adapters off; full/freeze: a frozen
    # copy sharded like the policy) or precompute (one pass before training, cached);
    # auto: live
    reference: ReferenceSetting = "auto"

    def problems(self, section: str) -> list[str]:
        """beta > 0; label_smoothing in [0, 0.5), and only for the losses that read it."""
        out = positive(self.beta, f"{section}.beta")
        out += label_smoothing_problems(self.label_smoothing, f"{section}.label_smoothing")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            out.append(
                f"{section}.label_smoothing = {self.label_smoothing} has no meaning for the "
                f"{self.loss_type} loss; it applies to loss_type sigmoid and robust; remove it"
            )
        return out


def pair_loss(policy: Scored, reference, s):
    """(losses, chosen, rejected) of DPO for pairs laid chosen, rejected, chosen, ..."""
    from keel.losses import preference as losses

    chosen, rejected = policy.sums[0::2], policy.sums[1::2]
    if s.loss_type == "ipo":  # IPO works on length-normalised log-ratios
        counts = policy.counts.clamp_min(1)
        out = losses.dpo_loss(
            policy.means[0::2],
            policy.means[1::2],
            reference[0::2] / counts[0::2],
            reference[1::2] / counts[1::2],
            beta=s.beta,
            loss_type="ipo",
        )
    else:
        out = losses.dpo_loss(
            chosen,
            rejected,
            reference[0::2],
            reference[1::2],
            beta=s.beta,
            loss_type=s.loss_type,
            label_smoothing=s.label_smoothing,
        )
    return out, chosen, rejected


STAGE = Stage(
    name="dpo",
    summary="direct preference optimization on pairs, against a reference model",
    unit="pair",
    sequences_per_row=2,
    uses_reference=True,
    metric_names=PAIR_METRICS,
    formats=PAIR_FORMATS,
    objective=sequence_objective,
    pair_loss=pair_loss,
    settings=DpoSettings,
)
