"""Loss functions: pure, torch-only, each with its formula and tests against hand values."""

from keel.losses.causal_lm import IGNORE_INDEX, chunked_cross_entropy, cross_entropy_sum
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
    "chunked_cross_entropy",
    "cross_entropy_sum",
    "dpo_loss",
    "kto_kl",
    "kto_loss",
    "orpo_loss",
    "simpo_loss",
]
