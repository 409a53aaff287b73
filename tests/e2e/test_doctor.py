"""`keel doctor` for real: a real 2-process smoke test and real failures. The readable
report comes from the CLI in a subprocess (its own interpreter, stdout and exit code); the
JSON ones from keel.cli.main in this process, which spares the doctor's ~15 s of library
imports per run (its smoke test is a real torchrun launch either way)."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from cli_support import keel_in_process

from keel.distributed.smoke import launch_smoke_test

DOCTOR_BUDGET_S = 60  # the doctor must answer within a minute on a CPU


def doctor(*args):
    """`keel doctor *args` as a user runs it: its own interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("KEEL_FAULT", "OMP_NUM_THREADS")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "keel", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done, time.monotonic() - started


@pytest.fixture
def doctor_here(monkeypatch):
    """`keel doctor --json` in this process, with `fault` (KEEL_FAULT) for its smoke test."""

    def run(fault=None):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        if fault:
            monkeypatch.setenv("KEEL_FAULT", fault)
        else:
            monkeypatch.delenv("KEEL_FAULT", raising=False)
        started = time.monotonic()
        done = keel_in_process("doctor", "--json")
        return done, time.monotonic() - started

    return run


def test_doctor_json_reports_a_machine_that_can_train(doctor_here):
    done, seconds = doctor_here()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seconds < DOCTOR_BUDGET_S, f"keel doctor took {seconds:.1f} s"
    report = json.loads(done.stdout)  # exactly one document: anything else fails to parse
    assert {"versions", "devices", "backends", "smoke_test", "problems"} <= report.keys()
    assert report["problems"] == []
    versions = report["versions"]
    assert {
        "python",
        "torch",
        "transformers",
        "peft",
        "datasets",
        "safetensors",
        "keel",
    } <= versions.keys()
    assert all(isinstance(v, str) and v for v in versions.values())
    for device in report["devices"]:
        assert isinstance(device["type"], str) and isinstance(device["name"], str)
        assert isinstance(device["memory_bytes"], int) and isinstance(device["bf16"], bool)
    cpu = next(d for d in report["devices"] if d["type"] == "cpu")
    assert cpu["memory_bytes"] > 0 and cpu["fp32_gflops"] > 0 and cpu["bf16_gflops"] > 0
    if abs(cpu["bf16_gflops"] / cpu["fp32_gflops"] - 1.5) > 0.01:  # clear of rounding
        assert cpu["bf16"] == (cpu["bf16_gflops"] >= 1.5 * cpu["fp32_gflops"])
    assert all(isinstance(v, bool) for v in report["backends"].values())
    assert report["backends"]["distributed"] and report["backends"]["gloo"]
    smoke = report["smoke_test"]
    assert smoke["ok"] is True and isinstance(smoke["seconds"], float)
    assert smoke["processes"] == 2
    assert smoke["detail"].startswith("2 processes via torchrun, backend gloo on cpu")
    assert "FSDP2 step" in smoke["detail"] and "same full params on every rank" in smoke["detail"]
    assert [c["name"] for c in smoke["checks"]] == [
        "all_reduce cpu",
        "broadcast_object",
        "barrier",
        "fsdp2 step",
    ]
    assert "keel doctor:" in done.stderr  # progress goes to stderr
    print(f"keel doctor --json: {seconds:.1f} s")


def test_doctor_prints_a_readable_report():
    done, seconds = doctor()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for section in (
        "Versions",
        "Devices",
        "Backends",
        "Shared memory",
        "Smoke test: passed",
        "Notes",
        "Problems",
    ):
        assert f"\n{section}" in f"\n{out}", section
    assert "  torch " in out and "  cpu " in out and "GFLOP/s" in out
    assert out.rstrip().splitlines()[-1].startswith("keel doctor: this machine can train")
    assert seconds < DOCTOR_BUDGET_S


def test_a_rank_that_dies_in_the_smoke_test_is_a_problem(doctor_here, monkeypatch):
    """KEEL_FAULT: rank 1 exits with code 1 at the start of check 5 (the FSDP2 step). Set
    after `os.environ` was rebound to a new object, as datasets' map with num_proc > 1 leaves
    it (an earlier test in this process may have): the smoke test must still pass it on."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    done, seconds = doctor_here(fault="exit:5:1")
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    smoke = report["smoke_test"]
    assert smoke["ok"] is False
    assert "rank 1 exited with code 1" in smoke["detail"]
    assert "keel.distributed.smoke FAILED" in smoke["stderr_tail"]  # torchrun's own report
    assert len(report["problems"]) == 1
    assert report["problems"][0].startswith("the 2-process smoke test failed")
    assert seconds < DOCTOR_BUDGET_S


def test_a_collective_that_times_out_names_the_check(tmp_path):
    """Rank 1 hangs before the broadcast; rank 0's gloo timeout ends the test with a reason."""
    env = {k: v for k, v in os.environ.items() if k != "KEEL_FAULT"} | {"KEEL_FAULT": "hang:3:1"}
    result = launch_smoke_test(timeout_s=50, collective_timeout_s=3, gpus=0, environ=env)
    assert result["ok"] is False
    assert "check 3 (broadcast_object) failed" in result["detail"]
    assert "rank 0" in result["detail"]


def test_a_hung_smoke_test_is_stopped_with_its_workers():
    """Past the doctor's own limit, torchrun and every worker are ended, none left behind."""
    env = {k: v for k, v in os.environ.items() if k != "KEEL_FAULT"} | {"KEEL_FAULT": "hang:3:1"}
    marker = "61.25"  # a collective timeout no other process uses: it marks our workers
    result = launch_smoke_test(timeout_s=8, collective_timeout_s=float(marker), gpus=0, environ=env)
    assert result["ok"] is False
    assert result["detail"].startswith("timed out after 8 s")
    assert 8 <= result["seconds"] < 20
    left = [
        p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []
