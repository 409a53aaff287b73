"""pt: continued pretraining, every token of plain text is a target."""

from keel.stages.base import Stage, causal_lm_objective

STAGE = Stage(
    name="pt",
    summary="pretraining: every token of plain text is a target",
    unit="text",
    sequences_per_row=1,
    uses_reference=False,
    metric_names=(),
    # chat formats are rendered to text with the template, then trained on every token
    formats=("text", "alpaca", "sharegpt", "messages"),
    objective=causal_lm_objective,
)
