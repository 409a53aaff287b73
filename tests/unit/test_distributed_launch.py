"""keel.distributed.launch: who started us, what we hand to torchrun, and the CLI flags."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from keel.cli import main, parse_args
from keel.distributed import launch as launch_mod
from keel.distributed.launch import (
    SHUTDOWN_TIMEOUT_S,
    LaunchSpec,
    WorldInfo,
    check_launch_args,
    detect_world,
    first_host,
    launch,
    needs_launch,
    slurm_rendezvous_env,
    torchrun_args,
)
from keel.errors import KeelError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = "examples/identity_lora.yaml"
SINGLE = WorldInfo(0, 1, 0, 1, "single")
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "3",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SRUN = {
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "8(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


# --- detect_world ---------------------------------------------------------------------


def test_plain_process_is_single():
    world = detect_world({"HOME": "/root"})
    assert world == SINGLE
    assert not world.is_distributed and world.is_main


def test_torchrun_env_is_torchrun():
    world = detect_world(TORCHRUN)
    assert world == WorldInfo(3, 8, 3, 4, "torchrun")
    assert world.is_distributed and not world.is_main


def test_torchrun_with_one_process_is_still_distributed():
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    world = detect_world(env)
    assert world.launcher == "torchrun" and world.is_distributed and world.is_main


def test_torchrun_started_inside_srun_wins_over_slurm():
    # keel's launcher in one srun task per node: the workers see both sets of variables.
    assert detect_world({**SRUN, "SLURM_NTASKS": "2", **TORCHRUN}).launcher == "torchrun"


def test_srun_task_per_gpu_is_slurm():
    assert detect_world(SRUN) == WorldInfo(9, 16, 1, 8, "slurm")


@pytest.mark.parametrize(
    "extra, local_world",
    [
        ({"SLURM_NTASKS_PER_NODE": "4"}, 4),  # explicit --ntasks-per-node wins
        ({"SLURM_TASKS_PER_NODE": "4"}, 4),
        ({"SLURM_TASKS_PER_NODE": "8(x1),4", "SLURM_NODEID": "1", "SLURM_LOCALID": "3"}, 4),
        ({"SLURM_TASKS_PER_NODE": None, "SLURM_LOCALID": "0"}, 1),
    ],
)
def test_slurm_local_world_size(extra, local_world):
    env = {**SRUN, **extra}
    env = {k: v for k, v in env.items() if v is not None}
    assert detect_world(env).local_world_size == local_world


def test_single_sbatch_task_is_single():
    # `sbatch --ntasks=1` running `keel train --nproc 4`: keel must launch, not join.
    env = {
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu01",
    }
    assert detect_world(env) == SINGLE


@pytest.mark.parametrize(
    "env, named",
    [
        ({**TORCHRUN, "RANK": "three"}, "RANK='three'"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({**TORCHRUN, "RANK": "8"}, "RANK=8"),
        ({**TORCHRUN, "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
        ({"LOCAL_RANK": "0"}, "RANK is not set"),
        ({**SRUN, "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two'"),
        ({**SRUN, "SLURM_PROCID": "16"}, "SLURM_PROCID=16"),
        ({**SRUN, "SLURM_TASKS_PER_NODE": "8(y2)"}, "SLURM_TASKS_PER_NODE='8(y2)'"),
        ({k: v for k, v in SRUN.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID is not set"),
    ],
)
def test_malformed_launcher_env_names_the_variable(env, named):
    with pytest.raises(KeelError, match=re.escape(named)):
        detect_world(env)


# --- slurm_rendezvous_env -------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node01", "node01"),
        ("node[01-04]", "node01"),
        ("gpu[3,5-7],cpu1", "gpu3"),
        ("a-b[001-002]", "a-b001"),
        ("cpu1,gpu[3-4]", "cpu1"),
        ("rack[2-3]-n[010-011]", "rack2-n010"),
        ("host.example.org", "host.example.org"),
    ],
)
def test_first_host_of_nodelist(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[01-04", "node]01[", "[]", "a[[1]]"])
def test_unreadable_nodelist_is_a_user_error(nodelist):
    with pytest.raises(KeelError, match="MASTER_ADDR"):
        first_host(nodelist)


def test_slurm_rendezvous_env_from_slurm_variables():
    assert slurm_rendezvous_env(SRUN) == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(29500 + 123456 % 1000),
    }


def test_slurm_rendezvous_env_keeps_user_master_and_old_nodelist_name():
    env = {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"}
    got = slurm_rendezvous_env(env)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.1", "12345")
    env = {k: v for k, v in SRUN.items() if k not in ("SLURM_JOB_NODELIST", "SLURM_JOB_ID")}
    got = slurm_rendezvous_env({**env, "SLURM_NODELIST": "n[5-6]"})
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("n5", "29500")


def test_slurm_rendezvous_env_is_empty_outside_srun():
    assert slurm_rendezvous_env({}) == {}
    assert slurm_rendezvous_env(TORCHRUN) == {}


@pytest.mark.parametrize(
    "env, named",
    [
        ({k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST"),
        ({**SRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({**SRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({**SRUN, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'"),
    ],
)
def test_slurm_rendezvous_env_errors_name_the_variable(env, named):
    with pytest.raises(KeelError, match=re.escape(named)):
        slurm_rendezvous_env(env)


# --- torchrun_args ---------------------------------------------------------------------

WORKER = ["train", "cfg.yaml", "train.lr=1e-4"]


def test_torchrun_args_single_node_is_standalone():
    args = torchrun_args(LaunchSpec(nproc=4, max_restarts=2), worker_args=WORKER)
    parsed = get_args_parser().parse_args(args)
    assert parsed.standalone and parsed.module
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.nnodes) == ("4", 2, "1:1")
    assert (parsed.training_script, parsed.training_script_args) == ("keel", WORKER)
    assert parsed.shutdown_timeout == SHUTDOWN_TIMEOUT_S


def test_torchrun_args_multi_node_uses_c10d_rendezvous():
    spec = LaunchSpec(nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    args = torchrun_args(spec, worker_args=["--debug", *WORKER])
    parsed = get_args_parser().parse_args(args)
    assert not parsed.standalone and parsed.module
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.nnodes) == (
        "c10d",
        "node0:29500",
        "2",
    )
    assert parsed.rdzv_id == "keel" and parsed.nproc_per_node == "8"
    # torchrun ignores --node-rank under c10d (and warns when it is not 0): not passed.
    assert parsed.node_rank == 0
    assert parsed.training_script_args == ["--debug", *WORKER]


# --- flag checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(nproc=0), "--nproc 0"),
        (dict(nproc=2, nnodes=0), "--nnodes 0"),
        (dict(nnodes=0), "--nnodes 0"),
        (dict(nproc=2, node_rank=2, nnodes=2, rdzv_endpoint="h:1"), "--node-rank 2"),
        (dict(nproc=8, nnodes=2), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (dict(nproc=8, nnodes=2, rdzv_endpoint="node0"), "--rdzv-endpoint 'node0'"),
        (dict(nproc=8, nnodes=2, rdzv_endpoint=":29500"), "--rdzv-endpoint ':29500'"),
        (dict(nproc=8, nnodes=2, rdzv_endpoint="node0:99999"), "--rdzv-endpoint 'node0:99999'"),
        (dict(nproc=2, max_restarts=-1), "--max-restarts -1"),
        (dict(max_restarts=3), "--nproc 1 --max-restarts 3"),
        (dict(node_rank=1), "--node-rank 1 needs --nproc"),
        (dict(rdzv_endpoint="node0:29500"), "--rdzv-endpoint node0:29500 needs --nproc"),
    ],
)
def test_bad_launch_flags_name_the_flag(changes, named):
    with pytest.raises(KeelError, match=re.escape(named)):
        needs_launch(SINGLE, LaunchSpec(**changes))


def test_needs_launch_decisions():
    assert needs_launch(SINGLE, LaunchSpec()) is False
    assert needs_launch(SINGLE, LaunchSpec(nproc=1, max_restarts=3)) is True
    assert needs_launch(SINGLE, LaunchSpec(nnodes=2, rdzv_endpoint="[::1]:29500")) is True
    # Inside a worker, no flags: just train.
    assert needs_launch(detect_world(TORCHRUN), LaunchSpec()) is False
    assert needs_launch(detect_world(SRUN), LaunchSpec()) is False
    # One srun task per node may run the launcher for its GPUs.
    per_node = {
        **SRUN,
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    assert (
        needs_launch(
            detect_world(per_node), LaunchSpec(nproc=8, nnodes=2, rdzv_endpoint="gpu07:29500")
        )
        is True
    )


@pytest.mark.parametrize(
    "env, changes",
    [
        (TORCHRUN, dict(nproc=2)),
        (TORCHRUN, dict(max_restarts=1)),
        (SRUN, dict(nproc=8, nnodes=2, rdzv_endpoint="gpu07:29500")),  # 8 tasks per node
        (
            {**SRUN, "SLURM_TASKS_PER_NODE": "1(x16)", "SLURM_LOCALID": "0"},
            dict(nproc=8, nnodes=2, rdzv_endpoint="gpu07:29500"),
        ),  # 16 tasks, 2 nodes
    ],
)
def test_launch_flags_clash_with_an_outer_launcher(env, changes):
    with pytest.raises(KeelError, match="already running under torchrun/srun"):
        needs_launch(detect_world(env), LaunchSpec(**changes))


def test_nnodes_without_nproc_starts_one_worker_per_node():
    spec = LaunchSpec.from_flags(parse_args(["train", "c.yaml", "--nnodes", "2"]))
    assert spec == LaunchSpec(nnodes=2) and spec.given_flags() == ["--nnodes 2"]
    args = torchrun_args(LaunchSpec(nnodes=2, rdzv_endpoint="node0:29500"), worker_args=WORKER)
    assert get_args_parser().parse_args(args).nproc_per_node == "1"


def test_check_launch_args_accepts_a_good_multi_node_setup():
    check_launch_args(
        LaunchSpec(nproc=8, nnodes=4, node_rank=3, rdzv_endpoint="10.1.2.3:29500", max_restarts=2)
    )


# --- launch (no real processes) ----------------------------------------------------------


class FakeTorchrun:
    """Stands in for subprocess.Popen: records the command, replays scripted waits."""

    def __init__(self, waits):
        self.waits, self.calls, self.signals = list(waits), [], []

    def __call__(self, cmd, env):
        self.calls.append((cmd, env))
        return self

    def wait(self, timeout=None):
        outcome = self.waits.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")


def run_launch(monkeypatch, waits, **changes):
    fake = FakeTorchrun(waits)
    monkeypatch.setattr(launch_mod.subprocess, "Popen", fake)
    lines: list[str] = []
    spec = LaunchSpec(**{"nproc": 2, "max_restarts": 1, **changes})
    code = launch(spec, worker_args=WORKER, log=lines.append)
    return code, fake, lines


def test_launch_runs_torchrun_module_and_returns_its_code(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(
        launch_mod.os, "sched_getaffinity", lambda pid: set(range(9)), raising=False
    )
    code, fake, lines = run_launch(monkeypatch, [1])
    ((cmd, env),) = fake.calls
    assert code == 1
    assert cmd[1:3] == ["-m", "keel.distributed.torchrun"]  # torchrun, with workers' codes
    assert cmd[3:] == torchrun_args(LaunchSpec(nproc=2, max_restarts=1), worker_args=WORKER)
    assert env["OMP_NUM_THREADS"] == "4"  # 9 cores // 2 workers, not torchrun's 1
    assert len(lines) == 1 and "2 worker(s)" in lines[0] and "train cfg.yaml" in lines[0]


def test_launch_keeps_the_users_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _, fake, _ = run_launch(monkeypatch, [0], nproc=64)
    assert fake.calls[0][1]["OMP_NUM_THREADS"] == "3"


def test_ctrl_c_waits_for_torchrun_instead_of_killing_it(monkeypatch):
    code, fake, lines = run_launch(monkeypatch, [KeyboardInterrupt(), 1])
    assert code == 130 and fake.signals == [] and "interrupted" in lines[-1]


def test_ctrl_c_escalates_when_torchrun_does_not_stop(monkeypatch):
    timeout = subprocess.TimeoutExpired("torchrun", 60)
    code, fake, _ = run_launch(monkeypatch, [KeyboardInterrupt(), timeout, 0])
    assert code == 130 and fake.signals == ["TERM"]
    code, fake, _ = run_launch(monkeypatch, [KeyboardInterrupt(), KeyboardInterrupt(), 0])
    assert code == 130 and fake.signals == ["KILL"]


def test_launch_validates_before_starting_anything(monkeypatch):
    with pytest.raises(KeelError, match="--nproc 0"):
        run_launch(monkeypatch, [], nproc=0)


# --- the CLI -----------------------------------------------------------------------------


@pytest.fixture
def plain_env(monkeypatch):
    """No launcher variables from the machine running the tests."""
    for name in [*launch_mod.TORCHRUN_VARS, "SLURM_NTASKS", "SLURM_PROCID"]:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--max-restarts", "2"], "--nproc 1 --max-restarts 2"),
        (["--nproc", "2", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nproc", "0"], "--nproc 0"),
        (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint"),
    ],
)
def test_cli_flag_errors_exit_2_before_the_config_is_read(plain_env, tmp_path, capsys, argv, named):
    missing = str(tmp_path / "missing.yaml")
    assert main(["train", missing, *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "does not exist" not in err and "Traceback" not in err


def test_cli_refuses_to_launch_inside_torchrun(monkeypatch, capsys):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "missing.yaml", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "already running under torchrun/srun (RANK=3)" in err and "--nproc 2" in err


def test_cli_bad_config_fails_once_before_launching(plain_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: pytest.fail("launched"))
    assert main(["train", str(tmp_path / "missing.yaml"), "--nproc", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_launches_workers_with_the_same_arguments(plain_env, monkeypatch):
    seen = {}
    monkeypatch.setattr(launch_mod, "launch", lambda spec, **kw: seen.update(kw, spec=spec) or 7)
    monkeypatch.chdir(ROOT)
    argv = [
        "--debug",
        "train",
        EXAMPLE_CONFIG,
        "train.lr=1e-4",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "train.epochs=1",
    ]
    assert main(argv) == 7
    assert seen["worker_args"] == [
        "--debug",
        "train",
        EXAMPLE_CONFIG,
        "train.lr=1e-4",
        "train.epochs=1",
    ]
    assert seen["spec"] == LaunchSpec(nproc=2, nnodes=1, max_restarts=1)


def test_overrides_may_follow_the_flags():
    args = parse_args(["train", "c.yaml", "a=1", "--nproc", "8", "b=2"])
    assert (args.config, args.overrides, args.nproc) == ("c.yaml", ["a=1", "b=2"], 8)
    with pytest.raises(SystemExit):
        parse_args(["train", "c.yaml", "--nproc", "8", "--no-such-flag"])


# --- shipped launch scripts ----------------------------------------------------------------

SCRIPTS = ["examples/slurm_two_nodes.sbatch", "examples/torchrun_two_nodes.sh"]
SHELL_VALUES = {
    "SLURM_NNODES": "2",
    "head": "gpu07",
    "HEAD": "node0",
    "port": "29956",
    "PORT": "29500",
    "NODE_RANK": "1",
    "SLURM_JOB_ID": "123456",
}


def command_lines(path: Path, word: str) -> list[str]:
    """Commands in a shell script from `word` on, continuations joined, variables filled.

    Prose comments are skipped; indented comment lines (`#   srun ...`) are example
    commands that users copy, so they are checked too.
    """
    text = re.sub(r"\\\n\s*(#\s*)?", " ", path.read_text())
    commands = []
    for line in text.splitlines():
        if word in line and (not line.lstrip().startswith("#") or re.match(r"#\s{2,}", line)):
            command = line[line.index(word) :]
            commands.append(re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_VALUES[m.group(1)], command))
    return commands


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_script_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_keel_commands_in_launch_scripts_parse(script):
    commands = command_lines(ROOT / script, "keel train ")
    assert commands
    for command in commands:
        args = parse_args(shlex.split(command)[1:])
        assert (ROOT / args.config).is_file()
        assert all("=" in item for item in args.overrides)
        needs_launch(SINGLE, LaunchSpec.from_flags(args))


def test_plain_torchrun_command_in_script_parses():
    (command,) = command_lines(ROOT / "examples/torchrun_two_nodes.sh", "torchrun --")
    parsed = get_args_parser().parse_args(shlex.split(command)[1:])
    assert parsed.module and parsed.training_script == "keel"
    assert parsed.training_script_args[:2] == ["train", EXAMPLE_CONFIG]
