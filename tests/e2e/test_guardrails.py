"""Stalls and out-of-memory in one process, met for real through KEEL_FAULT (keel.faults).

The abort on a stall is a real process (the watchdog ends it with exit 5); the other runs go
through keel.cli.main in the test process (the same training, its exit code main's, without
an interpreter start and the library imports for each)."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from cli_support import keel_in_process
from config_support import qa_rows, tiny_lora_config

ROWS = qa_rows(12)


@pytest.fixture
def workspace(tmp_path, tiny_model_dir):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps(ROWS))
    train = {"max_steps": 6, "scheduler": "constant"}
    config = tiny_lora_config(tiny_model_dir, data, tmp_path / "out", train=train)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def keel_train(config, *overrides, fault=None, out=None):
    env = {k: v for k, v in os.environ.items() if k not in ("KEEL_FAULT", "OMP_NUM_THREADS")}
    if fault:
        env["KEEL_FAULT"] = fault
    extra = [f"output.dir={out}"] if out else []
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "keel", "train", str(config), *extra, *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return done, time.monotonic() - started


def losses(out) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r
    }


STALL = ("watchdog.stall_timeout_s=1.5",)


def test_a_stall_is_reported_with_the_stack_and_the_run_goes_on(workspace, tmp_path, monkeypatch):
    # In this process: the report is the watchdog thread's, printed to stderr as it runs.
    monkeypatch.setenv("KEEL_FAULT", "stall:3:0:4")
    done = keel_in_process("train", str(workspace), *STALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 3 has run for" in done.stderr and "still waiting" in done.stderr
    assert "at_step_start" in done.stderr  # the main thread's stack, where it sleeps
    assert "rss_mb" in done.stderr  # the memory state
    dumps = list((tmp_path / "out/diagnostics").glob("stall-step-00000003-*.txt"))
    assert len(dumps) == 1 and "Thread MainThread" in dumps[0].read_text()
    assert sorted(losses(tmp_path / "out")) == [1, 2, 3, 4, 5, 6]


def test_a_stall_aborts_with_exit_5_when_asked(workspace, tmp_path):
    done, seconds = keel_train(workspace, *STALL, "watchdog.on_stall=abort", fault="stall:3:0:60")
    assert done.returncode == 5, done.stderr[-3000:]
    assert "aborting (watchdog.on_stall=abort)" in done.stderr
    assert seconds < 45  # not the 60 s the step would have slept


def test_no_stall_report_without_a_stall(workspace, tmp_path, monkeypatch):
    """The negative control: the same limit, no fault, no report."""
    monkeypatch.delenv("KEEL_FAULT", raising=False)
    done = keel_in_process("train", str(workspace), *STALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stall" not in done.stderr
    assert not (tmp_path / "out/diagnostics").exists()


def test_out_of_memory_exits_3_with_a_message_and_the_checkpoint_resumes(
    workspace, tmp_path, monkeypatch
):
    # In this process: the out-of-memory error is main's exit 3, as the program's
    monkeypatch.setenv("KEEL_FAULT", "oom:5")
    done = keel_in_process("train", str(workspace))
    monkeypatch.delenv("KEEL_FAULT")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    message = done.stderr
    assert "out of memory in step 5 on rank 0, in a micro-batch of 2 row(s), the longest" in message
    assert "train.micro_batch_size=1" in message  # what to change
    assert "checkpoints/step-00000004, is intact" in message
    resumed = keel_in_process("train", str(workspace))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    clean = keel_in_process("train", str(workspace), f"output.dir={tmp_path / 'clean'}")
    assert clean.returncode == 0, clean.stderr[-3000:]
    got, want = losses(tmp_path / "out"), losses(tmp_path / "clean")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6)


def test_a_malformed_fault_is_a_user_error(workspace, monkeypatch):
    monkeypatch.setenv("KEEL_FAULT", "explode:3")
    done = keel_in_process("train", str(workspace))
    assert done.returncode == 2 and "KEEL_FAULT='explode:3'" in done.stderr
