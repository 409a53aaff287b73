"""Loss functions: pure, torch-only, each with its formula and tests against hand values."""

from keel.losses.causal_lm import IGNORE_INDEX, chunked_cross_entropy, cross_entropy_sum

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "cross_entropy_sum"]
