"""The vision-language demo learns: `make demo-vision`'s whole run (benchmarks/vision_demo.py).

A LLaVA model assembled from the bundled SmolLM2 and a random CLIP tower answers held-out
questions about pictures it never saw in sentences before training (no exact answer), and
names the shape and the colour after `keel train` of examples/vision_llava_demo.yaml. The
run takes about 10 minutes on 2 cores, so `make test` leaves it out (marker `demo`);
`make test-demo` runs it. The README's table is this run's numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.demo]

# The README's run: shape 68%, colour 100% (the demo's aim, near 100% for both, is not met yet)
SHAPE_AT_LEAST = 0.55  # chance: 1/3 (circle, square, triangle)
COLOUR_AT_LEAST = 0.9  # chance: 1/6


def test_demo_learns_shapes_and_colours(tmp_path, bundled_cache_dir):
    out = tmp_path / "demo"
    command = [sys.executable, "benchmarks/vision_demo.py", "--out", str(out)]
    settings = [f"--set=model.cache_dir={bundled_cache_dir}"]
    done = subprocess.run(
        [*command, *settings], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    before, after = results["before"], results["after"]
    assert before["overall"] == 0  # untrained, it answers in sentences ("The shape is a")
    assert after["shape"] >= SHAPE_AT_LEAST, after["replies"]
    assert after["colour"] >= COLOUR_AT_LEAST, after["replies"]
    assert results["losses"][-1] < results["losses"][0] / 10
