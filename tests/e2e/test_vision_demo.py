"""The vision-language demo learns: benchmarks/vision_demo.py, reduced, on the real bundled model.

A LLaVA model assembled from the bundled SmolLM2 and a random CLIP tower answers held-out
questions about pictures it never saw at chance level or below before training, and well
above chance after a short `keel train` run of examples/vision_llava_demo.yaml (the README's
table is the full run: more pictures and steps).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_support import ROOT

pytestmark = pytest.mark.slow

# Reduced run: 32x32 pictures in 16x16 patches (4 image tokens), 240 pictures, 40 steps.
REDUCED = ["--size", "32", "--patch", "16", "--train", "240", "--heldout", "24"]
SETTINGS = ["train.max_steps=40", "train.lr=3e-3", "output.save_every=0", "train.threads=1"]
CHANCE = (1 / 3 + 1 / 6) / 2  # half the questions name one of 3 shapes, half one of 6 colours


def test_demo_learns_shapes_and_colours(tmp_path, bundled_cache_dir):
    out = tmp_path / "demo"
    overrides = [f"--set={item}" for item in [*SETTINGS, f"model.cache_dir={bundled_cache_dir}"]]
    command = [sys.executable, "benchmarks/vision_demo.py", "--out", str(out), *REDUCED]
    done = subprocess.run(
        [*command, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    before, after = results["before"], results["after"]
    assert before["overall"] == 0  # untrained, it answers in sentences ("The shape is a")
    assert after["overall"] >= 1.5 * CHANCE, after["replies"]
    assert results["losses"][-1] < results["losses"][0] / 4
