"""`keel train --nproc N` exits with the workers' own code, not torchrun's 1: a script or
SLURM's requeue logic sees 2 (user error), 3 (out of memory), 4 (hang), 5 (stall),
6 (diverged) or 7 (preempted) whatever the process count. The hang is met in
test_watchdog.py::test_a_hanging_rank_is_named_and_the_job_ends."""

import subprocess
import sys

import pytest
from multiproc import RUN_TIMEOUT_S, Workspace, _env

from keel.distributed.torchrun import exit_code_of


@pytest.mark.parametrize(
    "failures,code",
    [
        ({0: (4, 10), 1: (-15, 10)}, 4),  # the hang's rank, and the peer torchrun ended
        ({0: (1, 9), 1: (3, 10)}, 3),  # keel's code wins over an earlier plain failure
        ({0: (7, 10), 1: (2, 9)}, 2),  # the first of keel's codes
        ({0: (5, 10), 1: (6, 10)}, 5),  # at the same time: the lowest rank
        ({0: (1, 10), 1: (-15, 10)}, 1),  # a traceback
        ({0: (-9, 10), 1: (-15, 11)}, 137),  # killed by SIGKILL, as a shell reports it
    ],
)
def test_the_code_that_says_what_happened_wins(failures, code):
    assert exit_code_of(failures) == code


WORKER = """
import os, sys, time
if os.environ["RANK"] == "1":
    os._exit(4)  # as the hang watchdog ends a process: no exception, no error file
time.sleep(120)  # rank 0: ended by torchrun (SIGTERM)
"""


def test_torchrun_exits_with_the_workers_code(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel.distributed.torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--shutdown-timeout",
            "10",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=_env(),
    )
    assert done.returncode == 4, done.stderr[-4000:]
    assert "rank 1: 4" in done.stderr and "exiting with 4" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_user_error_met_by_the_workers_exits_2(tmp_path_factory, tiny_model_dir):
    """The launcher reads the config only; the data is read by the workers."""
    workspace = Workspace(tmp_path_factory.mktemp("exit-codes"), tiny_model_dir)
    bad = workspace.root / "bad.json"
    bad.write_text('[{"instruction": "a", "output": "b"},')
    args = workspace.command("out", f"data.datasets=[{bad}]", "--nproc", "2")
    done = subprocess.run(
        args, cwd=workspace.root, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env()
    )
    assert done.returncode == 2, done.stderr[-4000:]
    assert "invalid row(s) in the training data" in done.stderr
