"""SIGTERM to a real 2-process run under torchrun: every rank finishes its step, they agree,
save one checkpoint and exit 7; the same command resumes, and the losses equal an
uninterrupted run's exactly (fp32, same seed). The signal may reach the workers (SLURM's
tasks) or the launcher (Kubernetes' PID 1, `scancel --signal`, a batch script passing on
SLURM's `--signal=B:USR1@90`): the launcher passes it on as SIGTERM and never restarts a
preempted run. The workers meet SIGTERM the same way on every path, so the resume is run
once (on the workers' path); the launcher's paths check that SIGTERM reached the workers and
that they saved exactly as there (one complete checkpoint, exit 7, no restart)."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from multiproc import RUN_TIMEOUT_S, Workspace, _env, train_losses

from keel.checkpoint.layout import complete_checkpoints

# fp32, no periodic checkpoints (the default, when SIGTERM used to lose the whole run)
RUN = ("train.max_steps=8", "output.save_every=0", "output.log_every=1")
# Rank 0 sleeps at the start of step 3, so the signal (sent once step 2 is logged) usually
# arrives while both ranks are in step 3; later (a loaded machine) it stops at a later step.
STALL_S = 8


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("preempt"), tiny_model_dir)


def workers(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The keel workers torchrun started (its children), as SLURM would signal each task."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [
            child
            for child in psutil.Process(launcher.pid).children(recursive=True)
            if "RANK" in child.environ()  # torchrun sets it for its workers only
        ]
        if len(found) == 2:
            return found
        time.sleep(0.1)
    raise AssertionError("the 2 workers were not found")


def wait_for_step(out, step: int, proc: subprocess.Popen) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (metrics.exists() and step in train_losses(out)):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "training never reached the step"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(workspace) -> Path:
    return workspace.train("full", *RUN, nproc=2)


def preempt(
    workspace: Workspace,
    name: str,
    send: Callable[[subprocess.Popen], None],
    flags: tuple[str, ...] = (),
) -> tuple[int, str, Path]:
    """Start `keel train --nproc 2`, call `send(launcher)` once step 2 is logged, and wait
    for the end: (exit code, output, output.dir)."""
    out = workspace.root / name
    command = workspace.command(out, *RUN, "--nproc", "2", *flags)
    env = {**_env(), "KEEL_FAULT": f"stall:3:0:{STALL_S}"}
    proc = subprocess.Popen(
        command, cwd=workspace.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_for_step(out, 2, proc)
        send(proc)
        output = proc.communicate(timeout=RUN_TIMEOUT_S)[0].decode()
    finally:
        if proc.poll() is None:  # a failed assertion above: leave no process behind
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    return proc.returncode, output, out


def check_saved_once(code: int, output: str, out: Path) -> int:
    """The preempted run exited 7 with one complete checkpoint, at the step it names, and
    no summary (it did not finish, nor was it restarted to finish): that step."""
    assert code == 7, output[-4000:]  # the workers' code, through torchrun
    stopped = re.search(r"preempted: SIGTERM arrived .* finished step (\d+)", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 3 <= step < 8
    assert [p.name for p in complete_checkpoints(out)] == [f"step-{step:08d}"]
    assert not (out / "keel_run.json").exists()
    assert sorted(train_losses(out)) == list(range(1, step + 1))
    return step


def test_sigterm_saves_once_exits_7_and_the_same_command_resumes_exactly(workspace, uninterrupted):
    def to_each_worker(launcher: subprocess.Popen) -> None:  # as SLURM signals each task
        for worker in workers(launcher):
            worker.send_signal(signal.SIGTERM)

    code, output, out = preempt(workspace, "preempted", to_each_worker)
    step = check_saved_once(code, output, out)

    # the same command, without the test's stall
    workspace.train(out.name, *RUN, nproc=2)
    assert f"at step {step}" in workspace.last_output
    assert train_losses(out) == train_losses(uninterrupted)  # exactly
    assert len(train_losses(out)) == 8


def test_sigterm_to_the_launcher_is_passed_on_and_saves_once(workspace):
    """Kubernetes sends SIGTERM to the container's PID 1, `keel train --nproc 2` itself."""
    code, output, out = preempt(
        workspace, "launcher-sigterm", lambda launcher: launcher.send_signal(signal.SIGTERM)
    )
    check_saved_once(code, output, out)
    assert "SIGTERM received; passing it on to torchrun" in output


def test_sigusr1_to_the_launcher_saves_once_and_is_never_restarted(workspace):
    """SLURM's --signal=B:USR1@90, passed on by the batch script; the workers' config has
    no train.preempt_signal (SIGUSR1 would kill them), so they are sent SIGTERM. With
    --max-restarts torchrun would restart the preempted workers, which would then finish."""
    flags = ("--max-restarts", "1")
    code, output, out = preempt(
        workspace, "launcher-usr1", lambda launcher: launcher.send_signal(signal.SIGUSR1), flags
    )
    check_saved_once(code, output, out)
    assert "SIGUSR1 received; sent SIGTERM to 2 worker(s)" in output


# Records each start, and exits 7 on SIGTERM as a keel worker does after its checkpoint.
FAKE_WORKER = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
Path(sys.argv[1], f"rank{os.environ['RANK']}-attempt{attempt}").touch()
time.sleep(120)
"""


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])
def test_torchrun_passes_preemption_on_as_sigterm_and_never_restarts(tmp_path, number):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    started = tmp_path / "started"
    started.mkdir()
    command = [
        *(sys.executable, "-m", "keel.distributed.torchrun", "--standalone"),
        *("--nproc-per-node", "2", "--max-restarts", "3", str(script), str(started)),
    ]
    proc = subprocess.Popen(command, env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(os.listdir(started)) < 2:  # both workers have their handler
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(number)
        stderr = proc.communicate(timeout=RUN_TIMEOUT_S)[1]
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    assert proc.returncode == 7, stderr[-4000:]
    assert sorted(os.listdir(started)) == ["rank0-attempt0", "rank1-attempt0"], stderr[-4000:]
    assert "exiting with 7" in stderr and "Traceback" not in stderr
