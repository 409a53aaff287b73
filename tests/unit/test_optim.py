"""Learning-rate schedule shapes and step planning."""

import pytest

from keel.config import TrainConfig
from keel.train.optim import lr_factor, warmup_steps_for


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_then_decay(kind):
    factors = [lr_factor(s, total_steps=10, warmup=2, kind=kind) for s in range(10)]
    assert factors[0] == pytest.approx(1 / 3) and factors[1] == pytest.approx(2 / 3)
    assert factors[2] == pytest.approx(1.0)
    if kind == "constant":
        assert all(f == 1.0 for f in factors[2:])
    else:
        assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
        assert factors[-1] < 0.2


def test_cosine_midpoint():
    assert lr_factor(5, total_steps=10, warmup=0, kind="cosine") == pytest.approx(0.5)


def test_warmup_ratio_and_steps():
    assert warmup_steps_for(TrainConfig(warmup_ratio=0.1), 50) == 5
    assert warmup_steps_for(TrainConfig(warmup_steps=3, warmup_ratio=0.5), 50) == 3
