"""The vision-language demo learns: `make demo-vision`'s whole run (benchmarks/vision_demo.py).

A LLaVA model assembled from the bundled SmolLM2 and a random CLIP tower answers held-out
questions about pictures it never saw in sentences before training (no exact answer), and
names the shape and the colour after `keel train` of examples/vision_llava_demo.yaml. The
run takes about 10 minutes on 2 cores (9.6 measured), so `make test` leaves it out (marker `demo`);
`make test-demo` runs it. The README's table is this run's numbers.
"""

from __future__ import annotations

import pytest
from cli_support import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.demo]

# The README's run (150 steps): shape 98% (39 of 40), colour 100%; a 200-step run of the
# same recipe reached 100% on both. The margin is for another machine's float rounding, not
# for a recipe that learns shapes worse: the old one (tower trained at the LM's lr) ended
# at 68-70% on shapes, and fails here.
SHAPE_AT_LEAST = 0.9  # chance: 1/3 (circle, square, triangle)
COLOUR_AT_LEAST = 0.95  # chance: 1/6


def test_demo_learns_shapes_and_colours(tmp_path, bundled_cache_dir):
    out = tmp_path / "demo"
    results = run_demo("vision_demo.py", out, bundled_cache_dir)
    before, after = results["before"], results["after"]
    assert before["overall"] == 0  # untrained, it answers in sentences ("The shape is a")
    assert after["shape"] >= SHAPE_AT_LEAST, after["replies"]
    assert after["colour"] >= COLOUR_AT_LEAST, after["replies"]
    assert results["losses"][-1] < results["losses"][0] / 10
