"""The GRPO demo learns: `make demo-grpo`'s whole run (benchmarks/grpo_demo.py).

The bundled SmolLM2 answers held-out one-digit sums ("What is 3 + 4?") greedily before and
after `keel train` of examples/grpo_sums.yaml (GRPO, LoRA, the reward file
examples/rewards/sums.py): trained only by a reward on other sums, it answers more of the
held-out ones right. The run takes minutes on 2 cores, so `make test` leaves it out (marker
`demo`); `make test-demo` runs it.
"""

from __future__ import annotations

import pytest
from cli_support import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.demo]

# Measured 2026-11-28 (train.threads=1 on 2 CPU cores shared with other jobs: 4.7 min of
# training, 8.6 min in all): held-out 45% -> 100%, training reward 0.17 (first 5 steps) ->
# 0.82 (last 5); an earlier run (one row per completion, other round-off) ended at 85%. The
# floor leaves room for that spread: 65% is 7 wrong answers, and still 4 more right than
# before training. This test (2 threads) gave 45% -> 100% too, in 19.9 min: it ran beside
# the vision demo's test, 4 threads on 2 cores; alone, expect about the demo's 9 minutes.
AFTER_AT_LEAST = 0.65


def test_demo_gets_better_at_heldout_sums(tmp_path, bundled_cache_dir):
    out = tmp_path / "demo"
    results = run_demo("grpo_demo.py", out, bundled_cache_dir)
    before, after = results["before"], results["after"]
    assert after["accuracy"] >= AFTER_AT_LEAST > before["accuracy"], after["replies"]
    rewards = results["reward"]
    assert sum(rewards[-5:]) > sum(rewards[:5])  # the training reward rose too
    assert (out / "grpo_demo.png").is_file()
