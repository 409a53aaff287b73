"""Loss functions: pure, torch-only, each with its formula and tests against hand values."""

from keel.losses.causal_lm import (
    IGNORE_INDEX,
    TokenWeighting,
    chunked_cross_entropy,
    chunked_weighted_cross_entropy,
    cross_entropy_sum,
    weighted_cross_entropy_sums,
)
from keel.losses.preference import (
    DPO_LOSS_TYPES,
    PairLosses,
    SampleLosses,
    dpo_loss,
    kto_kl,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "IGNORE_INDEX",
    "PairLosses",
    "SampleLosses",
    "TokenWeighting",
    "chunked_cross_entropy",
    "chunked_weighted_cross_entropy",
    "cross_entropy_sum",
    "dpo_loss",
    "kto_kl",
    "kto_loss",
    "orpo_loss",
    "simpo_loss",
    "weighted_cross_entropy_sums",
]
