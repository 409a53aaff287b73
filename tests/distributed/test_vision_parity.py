"""Vision-language training on 2 processes where one never sees an image == 1 process.

The design under test (keel.distributed.parallelize): the vision tower and projector are
kept whole on every rank, outside DDP's reducer and FSDP2's units, so a rank with a
text-only micro-batch makes exactly the collectives an image rank makes; a trainable tower's
gradients are averaged by one explicit all-reduce per optimizer step (zeros where a rank ran
no image) and clipped with the rest. See vision_worker.py for the runs: a tiny Qwen2-VL, two
optimizer steps of four micro-batches (rank 0: two with images, rank 1: two text-only),
fp32, dropout 0, AdamW, clipping at 1.0 (active: the norms are ~5), then a step with no image
on any rank.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vision_worker
import yaml
from cli_support import keel_in_process
from multiproc import RUN_TIMEOUT_S, train_losses
from vlm_support import build_tiny_qwen2_vl, write_colour_dataset, write_tiny_qwen2_vl_dir

WORKER = Path(__file__).with_name("vision_worker.py")
REL = 1e-5
CASES = (
    "frozen-lora:ddp",
    "frozen-lora:fsdp",
    "frozen-full:fsdp",
    "trainable-full:ddp",
    "trainable-full:fsdp",
    "unsynced:ddp",  # the negative control
)


def _launch(out: Path, nproc: int, specs) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + ["--nproc-per-node", str(nproc), str(WORKER), str(out), *specs],
        capture_output=True,
        text=True,
        timeout=240,  # a hang fails the test, not the CI job
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(case, strategy, nproc): found}: every case on 2 processes (one launch) and each
    distinct case once on 1 process (the reference)."""
    out = tmp_path_factory.mktemp("vision")
    _launch(out, 2, CASES)
    # The reference in this process: the worker's code path with one process, one thread
    # as the workers (a tower matmul's reduction order depends on the thread count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vision_worker.main(out, sorted({f"{spec.split(':')[0]}:ddp" for spec in CASES}))
    finally:
        torch.set_num_threads(threads)
    found = {}
    for path in out.glob("*.pt"):
        case, strategy, nproc = path.stem.rsplit("-", 2)
        found[case, strategy, int(nproc)] = torch.load(path)
    return found


def _assert_close_values(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= REL * abs(w), (got, want)


def _weight_diffs(got: dict, want: dict) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


@pytest.mark.parametrize("spec", [c for c in CASES if not c.startswith("unsynced")])
def test_text_only_rank_matches_one_process(runs, spec):
    case, strategy = spec.split(":")
    got, want = runs[case, strategy, 2], runs[case, "ddp", 1]
    _assert_close_values(got["losses"], want["losses"])
    _assert_close_values(got["grad_norms"], want["grad_norms"])
    diffs = _weight_diffs(got["weights"], want["weights"])
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-5, (worst, diffs[worst])
    if case.startswith("frozen"):  # the tower is bit for bit the initial one
        initial = _tower(build_tiny_qwen2_vl(seed=0).state_dict())
        assert _tower(got["weights"]).keys() == initial.keys()
        assert all(torch.equal(t, initial[k]) for k, t in _tower(got["weights"]).items())
        trained = _tower(runs["trainable-full", "fsdp", 2]["weights"])
        assert any(not torch.equal(t, initial[k]) for k, t in trained.items())


def _tower(weights: dict) -> dict:
    """The vision tower's tensors by their name inside it."""
    return {k.split("visual.", 1)[1]: v for k, v in weights.items() if "visual." in k}


def test_tower_gradients_must_be_averaged(runs):
    """Negative control: the same run without the tower's gradient all-reduce trains the
    language model identically (DDP averages it) but rank 0's tower moves differently."""
    got, want = runs["unsynced", "ddp", 2], runs["unsynced", "ddp", 1]
    diffs = _weight_diffs(got["weights"], want["weights"])
    tower = {k: d for k, d in diffs.items() if ".visual." in k}
    assert max(tower.values()) > 1e-3, max(tower.values())


def test_keel_train_with_a_trainable_tower_on_two_processes(tmp_path):
    """The real path (`keel train --nproc 2`, FSDP2, tower and projector trained): model
    set-up hands the replicated tower to the trainer, and the losses are one process's."""
    config = {
        "model": {
            "path": str(write_tiny_qwen2_vl_dir(tmp_path / "qwen2_vl")),
            "cache_dir": str(tmp_path / "cache"),
            "vision": {"freeze_tower": False, "freeze_projector": False},
        },
        "method": {"type": "full"},
        "data": {"datasets": [str(write_colour_dataset(tmp_path))], "cutoff_len": 128},
        "train": {
            "max_steps": 3,
            "micro_batch_size": 2,
            "global_batch_size": 6,
            "lr": 5e-3,
            "scheduler": "constant",
            "precision": "fp32",
            "threads": 1,
        },
        "distributed": {"strategy": "fsdp"},
        "output": {"dir": "unused"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    one = keel_in_process("train", str(path), f"output.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-4000:]
    two = subprocess.run(
        [sys.executable, "-m", "keel", "train", str(path), f"output.dir={tmp_path / 'two'}"]
        + ["--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert two.returncode == 0, two.stderr[-4000:]
    got, want = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert got.keys() == want.keys() and len(want) == 3
    _assert_close_values([got[s] for s in sorted(got)], [want[s] for s in sorted(want)])
