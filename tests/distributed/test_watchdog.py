"""Hangs met for real in 2-process runs: a rank that hangs, one that is stopped (SIGSTOP),
one that skips a collective. The watchdog must end the job within hang_timeout_s + 30 s,
name the rank, and leave the live ranks' stacks in <output.dir>/diagnostics/."""

import json
import signal
import subprocess
import time

import psutil
import pytest
from multiproc import Workspace, _env

HANG_TIMEOUT_S = 5
DEADLINE_S = HANG_TIMEOUT_S + 30
WATCH = (f"watchdog.hang_timeout_s={HANG_TIMEOUT_S}", "distributed.strategy=ddp")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("watchdog"), tiny_model_dir)


def start(workspace, out, *overrides, fault=None) -> subprocess.Popen:
    env = _env()
    if fault:
        env["KEEL_FAULT"] = fault
    args = workspace.command(out, *WATCH, *overrides, "--nproc", "2")
    return subprocess.Popen(
        args,
        cwd=workspace.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, started: float) -> tuple[int, str, float]:
    """Wait for the job; (exit code, output, seconds since `started`). Kills leftovers."""
    try:
        output, _ = proc.communicate(timeout=DEADLINE_S + 60)
    finally:
        for child in (
            psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        ):
            child.kill()
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output, time.monotonic() - started


def worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "keel" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker with rank {rank}")


def wait_for_step(out, step: int, proc: subprocess.Popen) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "training never reached the step"
        if metrics.exists() and sum(1 for _ in metrics.open()) >= step:
            return
        time.sleep(0.05)


def report(out) -> str:
    return (out / "diagnostics/hang-report.txt").read_text()


def test_a_hanging_rank_is_named_and_the_job_ends(workspace):
    out = workspace.root / "hang"
    proc = start(workspace, "hang", "train.max_steps=20", fault="hang:3:1")
    wait_for_step(out, 2, proc)
    code, output, seconds = finish(proc, time.monotonic())
    assert code == 4, output[-4000:]  # the watchdog's exit code, not torchrun's 1
    print(f"hang: the job ended {seconds:.1f} s after step 2")
    assert seconds < DEADLINE_S, seconds
    text = report(out)
    assert "made no progress" in text and "behind the others: rank(s) 1" in text, text
    assert "rank 1 (alive" in text and "at step 3: step begin" in text
    assert "behind the others: rank(s) 1" in output  # on the console too
    stacks = {r: (out / f"diagnostics/rank-{r:05d}-stacks.txt").read_text() for r in (0, 1)}
    assert "at_step_start" in stacks[1]  # where the hanging rank sleeps
    assert "train_step" in stacks[0]  # the live rank, waiting in its step


def test_a_stopped_rank_is_named_and_the_job_ends(workspace):
    """SIGSTOP: the rank's watchdog thread is frozen too; its heartbeat stops moving."""
    out = workspace.root / "stopped"
    proc = start(workspace, "stopped", "train.max_steps=400")
    victim = None
    try:
        wait_for_step(out, 2, proc)
        victim = worker(proc, 1)
        victim.send_signal(signal.SIGSTOP)
        code, output, seconds = finish(proc, time.monotonic())
    finally:
        if victim is not None and victim.is_running():
            victim.kill()
    assert code != 0, output[-4000:]
    print(f"SIGSTOP: the job ended {seconds:.1f} s after the signal")
    assert seconds < DEADLINE_S, seconds
    text = report(out)
    assert "not responding (no heartbeat; stopped, killed or frozen): rank(s) 1" in text, text
    assert (out / "diagnostics/rank-00000-stacks.txt").is_file()
    assert not (out / "diagnostics/rank-00001-stacks.txt").exists()


def test_a_skipped_collective_shows_where_the_ranks_diverge(workspace):
    out = workspace.root / "skip"
    proc = start(workspace, "skip", "train.max_steps=20", fault="skip_collective:3:1")
    code, output, seconds = finish(proc, time.monotonic())
    assert code != 0, output[-4000:]
    assert seconds < DEADLINE_S + 60  # start-up included
    text = report(out)
    line = next(x for x in text.splitlines() if "first differ" in x)
    assert "rank 0: all_reduce_sum(float64[1]) at step 3" in line, text
    # Rank 1 skipped that call: its own #15 is the next collective it made (which one
    # depends on the loop's collectives after a step), never the one rank 0 waits in.
    rank1 = line.split("rank 1: ", 1)[1]
    assert not rank1.startswith("all_reduce_sum(float64[1]) at step 3"), text


def test_a_healthy_run_leaves_no_diagnostics(workspace):
    """The negative control: the same watchdog settings, no fault."""
    out = workspace.train("healthy", *WATCH, nproc=2)
    assert not (out / "diagnostics").exists()
    summary = json.loads((out / "keel_run.json").read_text())
    assert summary["steps"] == 6
