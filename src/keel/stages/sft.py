"""sft: supervised fine-tuning, targets on the assistant turns of conversations only."""

from keel.stages.base import Stage, causal_lm_objective

STAGE = Stage(
    name="sft",
    summary="supervised fine-tuning: targets on assistant turns only",
    unit="conversation",
    sequences_per_row=1,
    uses_reference=False,
    metric_names=(),
    formats=("alpaca", "sharegpt", "messages"),
    objective=causal_lm_objective,
)
