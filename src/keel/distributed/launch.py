"""Start keel's workers through PyTorch's elastic launcher, and find out who started us.

keel writes no process launcher of its own: `keel train cfg.yaml --nproc N` runs
torch.distributed.run (torchrun) in a subprocess, which starts N copies of
`python -m keel train cfg.yaml ...`, handles rendezvous across nodes and restarts the
workers on failure. A worker (started by torchrun, or by SLURM's `srun` with one task
per GPU) learns its place with `detect_world`.

Only the standard library and keel.errors are imported here, so the launcher process
stays light; nothing here may import keel.train, keel.data or keel.cli.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from keel.errors import KeelError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
DEFAULT_PORT = 29500
TORCHRUN_MODULE = "keel.distributed.torchrun"
# torchrun groups the nodes of one job by this id; every node runs the same command, so a
# constant is enough (two keel jobs must not share an --rdzv-endpoint anyway).
RDZV_ID = "keel"
# How long torchrun may take to stop its workers after Ctrl-C before keel sends SIGTERM;
# torchrun itself waits 30 s per worker group before it escalates to SIGKILL.
INTERRUPT_GRACE_S = 60.0
# When one worker fails (or the watchdog ends a hung one), torchrun sends the others
# SIGTERM and waits this long before SIGKILL. Its default, 30 s, is spent in full on a
# stopped (SIGSTOP) or wedged worker; keel's workers hold nothing that needs longer.
SHUTDOWN_TIMEOUT_S = 10


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits among the workers of one run."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: Literal["single", "torchrun", "slurm"]

    @property
    def is_distributed(self) -> bool:
        """True when a launcher started us: the process group must be initialised, even
        for a torchrun world of one."""
        return self.launcher != "single"

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that logs and writes shared files."""
        return self.rank == 0


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """`keel train`'s launcher flags as the user gave them, built once by the CLI and read by
    every check, torchrun's arguments and the launch itself."""

    nproc: int | None = None  # None: --nproc not given
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0; None on one node
    max_restarts: int = 0

    @classmethod
    def from_flags(cls, flags) -> LaunchSpec:
        """From `keel train`'s parsed flags (an argparse namespace)."""
        return cls(
            nproc=flags.nproc,
            nnodes=flags.nnodes,
            node_rank=flags.node_rank,
            rdzv_endpoint=flags.rdzv_endpoint,
            max_restarts=flags.max_restarts,
        )

    @property
    def wants_launch(self) -> bool:
        """True when the flags ask for workers: --nproc, or --nnodes above 1."""
        return self.nproc is not None or self.nnodes != 1

    @property
    def workers_per_node(self) -> int:
        """--nproc; without it 1 (--nnodes 2 alone means one worker per node)."""
        return 1 if self.nproc is None else self.nproc

    def given_flags(self) -> list[str]:
        """The launcher flags that differ from their defaults, as the user typed them."""
        flags = [
            ("--nproc", self.nproc, None),
            ("--nnodes", self.nnodes, 1),
            ("--node-rank", self.node_rank, 0),
            ("--rdzv-endpoint", self.rdzv_endpoint, None),
            ("--max-restarts", self.max_restarts, 0),
        ]
        return [f"{flag} {value}" for flag, value, default in flags if value != default]


def _int_var(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    value = environ.get(name)
    if value is None:
        raise KeelError(
            f"{name} is not set, but the other launcher variables are; "
            f"set {name} or unset them all to run as a single process"
        )
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise KeelError(
            f"{name}={value!r} is not a whole number >= {minimum}; "
            "fix or unset it (torchrun and srun set it for you)"
        )
    return number


def _check_below(small_name: str, small: int, big_name: str, big: int) -> None:
    if small >= big:
        raise KeelError(
            f"{small_name}={small} must be below {big_name}={big}; "
            "the launcher environment is inconsistent, unset both or fix them"
        )


def _first_count(name: str, value: str) -> int:
    """The first task count of a SLURM list like '4', '4(x2)' or '2(x3),1'."""
    match = re.match(r"\s*(\d+)", value)
    if not match or int(match.group(1)) < 1:
        raise KeelError(f"{name}={value!r} is not a SLURM task count like '4' or '4(x2)'")
    return int(match.group(1))


def _slurm_tasks_on_this_node(environ: Mapping[str, str]) -> int:
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _first_count("SLURM_NTASKS_PER_NODE", environ["SLURM_NTASKS_PER_NODE"])
    value = environ.get("SLURM_TASKS_PER_NODE")
    if value is None:
        return 1
    # '2(x3),1' lists nodes in SLURM_NODEID order; uneven jobs differ per node.
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise KeelError(
                f"SLURM_TASKS_PER_NODE={value!r} is not a SLURM task list like '4' or '4(x2),1'"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = _int_var(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    return counts[node] if node < len(counts) else counts[0]


def _slurm_world(environ: Mapping[str, str]) -> WorldInfo:
    world = _int_var(environ, "SLURM_NTASKS", minimum=1)
    rank = _int_var(environ, "SLURM_PROCID")
    local_rank = _int_var(environ, "SLURM_LOCALID")
    local_world = _slurm_tasks_on_this_node(environ)
    _check_below("SLURM_PROCID", rank, "SLURM_NTASKS", world)
    _check_below("SLURM_LOCALID", local_rank, "tasks on this node", local_world)
    return WorldInfo(rank, world, local_rank, local_world, "slurm")


def _torchrun_world(environ: Mapping[str, str]) -> WorldInfo:
    rank = _int_var(environ, "RANK")
    world = _int_var(environ, "WORLD_SIZE", minimum=1)
    local_rank = _int_var(environ, "LOCAL_RANK")
    local_world = _int_var(environ, "LOCAL_WORLD_SIZE", minimum=1)
    _check_below("RANK", rank, "WORLD_SIZE", world)
    _check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world)
    return WorldInfo(rank, world, local_rank, local_world, "torchrun")


def detect_world(environ: Mapping[str, str]) -> WorldInfo:
    """Tell whether torchrun, `srun` (one task per GPU) or nobody started this process.

    torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) win; they are
    also set in workers that keel's own launcher started inside an `srun` task. A SLURM
    step counts only with more than one task: a single `sbatch` task running
    `keel train --nproc 4` is a plain process that launches its own workers.
    Raises KeelError naming the variable when a value is malformed or inconsistent.
    """
    if any(name in environ for name in TORCHRUN_VARS):
        return _torchrun_world(environ)
    if "SLURM_NTASKS" in environ and "SLURM_PROCID" in environ:
        if _int_var(environ, "SLURM_NTASKS", minimum=1) > 1:
            return _slurm_world(environ)
    return WorldInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")


def _split_top_level(nodelist: str) -> list[str]:
    """Split 'gpu[3,5-7],cpu1' at the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced brackets")
    return [*items, nodelist[start:]]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, zero padding kept.

    'node01' -> 'node01', 'node[01-04]' -> 'node01', 'gpu[3,5-7],cpu1' -> 'gpu3',
    'a-b[001-002]' -> 'a-b001'. Parsed here so that workers need not run `scontrol`.
    """
    try:
        head = _split_top_level(nodelist.strip())[0]
    except ValueError:
        head = ""
    # Each [...] group stands for its members; the first host takes the first of each.
    host = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], head)
    if not host or not re.fullmatch(r"[A-Za-z0-9._-]+", host):
        raise KeelError(
            f"SLURM node list {nodelist!r} has no host name keel can read; "
            "set MASTER_ADDR to the first node's address"
        )
    return host


def _master_port(environ: Mapping[str, str]) -> str:
    if "MASTER_PORT" in environ:
        port = _int_var(environ, "MASTER_PORT", minimum=1)
        if port > 65535:
            raise KeelError(f"MASTER_PORT={port} is not a TCP port; pick one below 65536")
        return str(port)
    if "SLURM_JOB_ID" not in environ:
        return str(DEFAULT_PORT)
    # Two jobs sharing a head node must not collide on one port.
    return str(DEFAULT_PORT + _int_var(environ, "SLURM_JOB_ID") % 1000)


def slurm_rendezvous_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The env:// variables to set before `init_process_group` in an `srun` task.

    Empty unless `detect_world(environ)` says "slurm" (torchrun sets these itself).
    MASTER_ADDR and MASTER_PORT are kept when set; otherwise the first host of
    SLURM_JOB_NODELIST (or SLURM_NODELIST) and 29500 + SLURM_JOB_ID % 1000.
    """
    world = detect_world(environ)
    if world.launcher != "slurm":
        return {}
    addr = environ.get("MASTER_ADDR")
    if not addr:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise KeelError(
                "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; "
                "export MASTER_ADDR=<first node> before srun"
            )
        addr = first_host(nodelist)
    return {
        "RANK": str(world.rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_RANK": str(world.local_rank),
        "LOCAL_WORLD_SIZE": str(world.local_world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": _master_port(environ),
    }


def torchrun_args(spec: LaunchSpec, *, worker_args: list[str], module: str = "keel") -> list[str]:
    """Arguments for torch.distributed.run that start `python -m <module> *worker_args`.

    One node without an endpoint uses `--standalone` (torchrun picks a free port).
    With an endpoint, the c10d rendezvous: the same command on every node. torchrun
    ignores --node-rank under c10d (ranks follow rendezvous order) and warns when it is
    not 0, so spec.node_rank is left out; keel uses it only to check the flags.
    """
    if spec.rdzv_endpoint is None:
        args = ["--standalone"]
    else:
        args = [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            spec.rdzv_endpoint,
            "--rdzv-id",
            RDZV_ID,
            "--nnodes",
            str(spec.nnodes),
        ]
    return [
        *args,
        "--nproc-per-node",
        str(spec.workers_per_node),
        "--max-restarts",
        str(spec.max_restarts),
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--module",
        module,
        *worker_args,
    ]


def check_launch_args(spec: LaunchSpec) -> None:
    """Raise KeelError naming the flag, its value and the fix for the first bad flag."""
    nproc, nnodes, node_rank = spec.workers_per_node, spec.nnodes, spec.node_rank
    rdzv_endpoint, max_restarts = spec.rdzv_endpoint, spec.max_restarts
    if nproc < 1:
        raise KeelError(
            f"--nproc {nproc}: need at least 1 worker per node "
            "(usually one per GPU, e.g. --nproc 8)"
        )
    if nnodes < 1:
        raise KeelError(f"--nnodes {nnodes}: need at least 1 node")
    if not 0 <= node_rank < nnodes:
        raise KeelError(
            f"--node-rank {node_rank}: must be between 0 and {nnodes - 1} for --nnodes {nnodes}"
        )
    if nnodes > 1 and rdzv_endpoint is None:
        raise KeelError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT "
            "(the address of node 0, same on every node)"
        )
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KeelError(
                f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT, "
                "e.g. node0:29500 (the address of node 0, same on every node)"
            )
    if max_restarts < 0:
        raise KeelError(f"--max-restarts {max_restarts}: must be 0 or more")


def needs_launch(world: WorldInfo, spec: LaunchSpec) -> bool:
    """Whether `keel train` must start workers through torchrun, given its flags and `world`.

    True for --nproc or --nnodes > 1 in a plain process, or in one `srun` task per node.
    Raises KeelError when the flags are bad or clash with the launcher that started us.
    """
    given = spec.given_flags()
    wants = spec.wants_launch
    if world.launcher == "torchrun" and given:
        raise KeelError(
            f"keel is already running under torchrun/srun (RANK={world.rank}); "
            f"drop {' '.join(given)} or launch with plain `keel train`"
        )
    # One srun task per node may run torchrun; more tasks per node would fight over GPUs.
    if (
        world.launcher == "slurm"
        and wants
        and (world.local_world_size > 1 or spec.nnodes != world.world_size)
    ):
        raise KeelError(
            f"keel is already running under torchrun/srun (RANK={world.rank}, "
            f"{world.world_size} srun task(s), {world.local_world_size} on this node); "
            f"drop {' '.join(given)} to run one srun task per GPU, or start one task per "
            "node (srun --ntasks-per-node=1) with --nnodes equal to the number of nodes"
        )
    if given and not wants:
        if spec.max_restarts:
            raise KeelError(
                f"--max-restarts {spec.max_restarts} needs the launcher: use "
                f"--nproc 1 --max-restarts {spec.max_restarts} "
                "(torchrun does the elastic restarts)"
            )
        raise KeelError(f"{given[0]} needs --nproc N (worker processes per node)")
    if wants:
        check_launch_args(spec)
    return wants


def _worker_env(environ: Mapping[str, str], nproc: int) -> dict[str, str]:
    env = dict(environ)
    if "OMP_NUM_THREADS" not in env:
        # torchrun would force 1 thread per worker; share this process's cores instead.
        # sched_getaffinity honours cgroup/taskset limits but is Linux-only.
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    return env


@contextmanager
def _forwarding_preemption(proc: subprocess.Popen, log: Callable[[str], None]) -> Iterator[None]:
    """Pass SIGTERM, SIGUSR1 and SIGUSR2 on to torchrun (keel.distributed.torchrun) while
    keel waits for it: it asks the workers to save a checkpoint, waits for them and exits
    with their 7. By default SIGTERM and SIGUSR1/2 would end this process at once (and,
    as Kubernetes' PID 1, SIGTERM would be ignored), leaving the workers unsaved."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python lets only the main thread set handlers
        return

    def forward(number: int, _frame) -> None:
        log(f"keel: {signal.Signals(number).name} received; passing it on to torchrun")
        proc.send_signal(number)

    numbers = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {number: signal.signal(number, forward) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _wait_after_interrupt(proc: subprocess.Popen) -> None:
    try:
        try:
            proc.wait(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            # The SIGINT may have reached keel alone (not the terminal's process group);
            # on SIGTERM torchrun asks the workers to save a checkpoint and stop (exit 7).
            proc.terminate()
            proc.wait()
    except KeyboardInterrupt:
        proc.kill()  # a second Ctrl-C: the user wants out now
        proc.wait()


def launch(spec: LaunchSpec, *, worker_args: list[str], log: Callable[[str], None] = print) -> int:
    """Run torchrun in a subprocess to start `spec.workers_per_node` keel workers here.

    Returns 0, or the failed workers' own exit code (keel's codes 2-7 first; see
    keel.distributed.torchrun: torchrun itself exits 1 whatever the workers had), or 130
    after Ctrl-C. SIGTERM, SIGUSR1 and SIGUSR2 are passed on to torchrun, which has the
    workers save a checkpoint and exit 7 (never restarted). Raises KeelError for bad flags
    before anything starts.
    """
    check_launch_args(spec)
    args = torchrun_args(spec, worker_args=worker_args)
    env = _worker_env(os.environ, spec.workers_per_node)
    where = (
        f"node {spec.node_rank} of {spec.nnodes}, rendezvous {spec.rdzv_endpoint}"
        if spec.rdzv_endpoint
        else "this node"
    )
    log(
        f"keel: launching {spec.workers_per_node} worker(s) on {where} via torchrun "
        f"(max {spec.max_restarts} restart(s), OMP_NUM_THREADS={env['OMP_NUM_THREADS']}): "
        f"python -m keel {' '.join(worker_args)}"
    )
    # torchrun's entry point, run by keel.distributed.torchrun to exit with the workers' code
    proc = subprocess.Popen([sys.executable, "-m", TORCHRUN_MODULE, *args], env=env)
    with _forwarding_preemption(proc, log):
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # The terminal sent SIGINT to torchrun too; it forwards it to the workers and
            # reaps them. Killing torchrun here would orphan workers that still hold GPUs.
            log(
                "keel: interrupted; waiting for torchrun to stop the workers "
                "(Ctrl-C again to kill it)"
            )
            _wait_after_interrupt(proc)
            return 130
