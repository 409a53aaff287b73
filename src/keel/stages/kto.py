"""kto: Kahneman-Tversky Optimization on samples labelled desirable or not, against a frozen
reference model, with a reference point z0 (the mean KL log-ratio of the global batch's
mismatched prompt/answer sequences, keel.data.kto) computed before the losses."""

from __future__ import annotations

from dataclasses import dataclass

from keel.stages.base import ReferenceSetting, Stage, positive, sequence_objective

KTO_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@dataclass(kw_only=True)
class KtoSettings:
    # Used with train.stage kto. A row is one labelled sample: train.micro_batch_size and
    # the global batch count samples.
    beta: float = 0.1  # KL strength: how far the policy may move from the reference
    # Reference log-probs: live (LoRA: the base with adapters off; full/freeze: a frozen
    # copy sharded like the policy) or precompute (one pass before training, cached);
    # auto: live
    reference: ReferenceSetting = "auto"
    desirable_weight: float = 1.0  # weight of desirable samples' losses
    undesirable_weight: float = 1.0  # weight of undesirable samples' losses

    def problems(self, section: str) -> list[str]:
        """beta and both weights > 0."""
        out = positive(self.beta, f"{section}.beta")
        out += positive(self.desirable_weight, f"{section}.desirable_weight")
        return out + positive(self.undesirable_weight, f"{section}.undesirable_weight")


STAGE = Stage(
    name="kto",
    summary="Kahneman-Tversky optimization on labelled samples, against a reference model",
    unit="sample",
    sequences_per_row=1,
    uses_reference=True,
    metric_names=KTO_METRICS,
    # TRL's unpaired preference format, or LLaMA-Factory's kto_tag data in the chat formats
    formats=("kto", "alpaca", "sharegpt", "messages"),
    objective=sequence_objective,
    settings=KtoSettings,
)
