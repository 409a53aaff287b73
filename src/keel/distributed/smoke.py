"""The multi-process smoke test behind `keel doctor`: collectives and one FSDP2 step, for real.

`launch_smoke_test` starts it through torchrun with keel's own launch flags
(`keel.distributed.launch.torchrun_args`), as `keel train --nproc 2` starts its workers:
`python -m torch.distributed.run --standalone --nproc-per-node 2 ... -m keel.distributed.smoke`,
with OMP_NUM_THREADS=1, a deadline, and the workers' stderr kept for the report.

Each rank joins the process group exactly as a training run does (`detect_world`, then
`join_world`: `gloo` on CPUs, `cpu:gloo,cuda:nccl` on GPUs, placement checked), then
runs these checks in order, each numbered:

  1  all_reduce of a CPU tensor (the CPU backend, gloo)
  2  all_reduce of a CUDA tensor (nccl); skipped when the ranks have no GPU
  3  broadcast_object from rank 0 (objects travel as CPU tensors: field note 1)
  4  barrier
  5  one FSDP2 step (`parallelize`) of a 2-Linear model: forward, backward, SGD step; every
     rank must end with the same full parameters, within 1e-5 of the same step unsharded

Rank 0 prints one line `keel-smoke-result {json}` on stdout when every check passed; a
failed check prints `keel-smoke: rank R: check N (...) failed: ...` on stderr and exits 1.

Fault injection (tests only): `KEEL_FAULT=<kind>:<check>[:<rank>[:<seconds>]]`, kind `exit`,
`hang` or `stall` (see keel.faults), fires at the start of check number <check> on <rank>.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from keel.distributed.launch import TORCHRUN_VARS, LaunchSpec, detect_world, torchrun_args
from keel.distributed.parallelize import ParallelizeSettings, full_value, parallelize
from keel.distributed.process_group import (
    DistContext,
    backend_for,
    exit_now,
    join_world,
    shutdown,
)
from keel.distributed.strategy import Strategy
from keel.faults import at_step_start, fault_from_env

MODULE = "keel.distributed.smoke"
NPROC = 2
RESULT_PREFIX = "keel-smoke-result "
FSDP_TOLERANCE = 1e-5
STDERR_TAIL_CHARS = 3000


def _all_reduce(ctx: DistContext, device: torch.device) -> str:
    tensor = torch.full((4,), float(ctx.rank + 1), device=device)
    dist.all_reduce(tensor)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    if not torch.all(tensor == expected):
        raise AssertionError(f"sum is {tensor.tolist()}, expected {expected} everywhere")
    return f"all_reduce of a {device.type} tensor: {expected:g} on every rank"


def _broadcast(ctx: DistContext) -> str:
    sent = {"from": 0, "payload": list(range(8))} if ctx.rank == 0 else None
    got = ctx.broadcast_object(sent)
    if got != {"from": 0, "payload": list(range(8))}:
        raise AssertionError(f"rank {ctx.rank} received {got!r}")
    return "broadcast_object from rank 0"


def _barrier(ctx: DistContext) -> str:
    ctx.barrier()
    return "barrier"


def _fsdp_step(ctx: DistContext) -> str:
    """One sharded step against the same step unsharded (the mean of every rank's loss)."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)).to(ctx.device)
    reference = copy.deepcopy(model)
    inputs = torch.randn(ctx.world_size, 4, 16, device=ctx.device)  # [ranks, B, in]
    targets = torch.randn(ctx.world_size, 4, 8, device=ctx.device)  # [ranks, B, out]
    sharded = ParallelizeSettings(strategy=Strategy.FSDP, units=list(model))
    parallelize(model, ctx.dims.with_strategy(Strategy.FSDP), sharded)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.functional.mse_loss(model(inputs[ctx.rank]), targets[ctx.rank])
    loss.backward()  # FSDP2 averages the gradients over the ranks
    optimizer.step()
    full = torch.cat([full_value(p.detach()).flatten() for p in model.parameters()])

    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = [nn.functional.mse_loss(reference(x), y) for x, y in zip(inputs, targets)]
    torch.stack(ref_losses).mean().backward()
    ref_optimizer.step()
    expected = torch.cat([p.detach().flatten() for p in reference.parameters()])

    rank0 = ctx.broadcast_object(full.cpu())
    if not torch.equal(rank0, full.cpu()):
        raise AssertionError(f"rank {ctx.rank}'s full parameters differ from rank 0's")
    error = (full - expected).abs().max().item()
    if error > FSDP_TOLERANCE:
        raise AssertionError(
            f"sharded step differs from the unsharded one by {error:.2e} (> {FSDP_TOLERANCE})"
        )
    return (
        f"FSDP2 step of 2 Linear layers ({full.numel()} params): same full params on "
        f"every rank, max |diff| vs unsharded {error:.1e}"
    )


def _checks(ctx: DistContext) -> list[tuple[int, str, Callable[[], str] | None]]:
    """(number, name, run) for each check; run is None where the check does not apply."""
    cuda = ctx.device if ctx.device.type == "cuda" else None
    return [
        (1, "all_reduce cpu", lambda: _all_reduce(ctx, torch.device("cpu"))),
        (2, "all_reduce cuda", (lambda: _all_reduce(ctx, cuda)) if cuda else None),
        (3, "broadcast_object", lambda: _broadcast(ctx)),
        (4, "barrier", lambda: _barrier(ctx)),
        (5, "fsdp2 step", lambda: _fsdp_step(ctx)),
    ]


def run_checks(ctx: DistContext) -> list[dict]:
    """Run every check in order on this rank; raises on the first that fails."""
    fault = fault_from_env()
    results = []
    for number, name, run in _checks(ctx):
        if run is None:
            continue
        at_step_start(fault, number, ctx.rank)
        start = time.perf_counter()
        try:
            detail = run()
        except Exception as exc:
            raise RuntimeError(
                f"check {number} ({name}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        results.append(
            {
                "check": number,
                "name": name,
                "detail": detail,
                "seconds": round(time.perf_counter() - start, 4),
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keel.distributed.smoke")
    parser.add_argument(
        "--timeout", type=float, default=20.0, help="collective timeout in seconds (default 20)"
    )
    args = parser.parse_args(argv)
    world = detect_world(os.environ)
    if not world.is_distributed:
        print(
            "keel-smoke: run `keel doctor`, which starts this module through torchrun",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    try:
        ctx = join_world(
            world,
            timeout_s=args.timeout,
            preprocess_timeout_s=args.timeout,
            log=lambda message: print(message, file=sys.stderr),
        )
    except Exception as exc:
        print(
            f"keel-smoke: rank {world.rank}: process group start-up failed: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    init_s = time.perf_counter() - started
    try:
        results = run_checks(ctx)
    except Exception as exc:
        print(f"keel-smoke: rank {ctx.rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    if ctx.is_main:
        summary = {
            "world_size": ctx.world_size,
            "device": ctx.device.type,
            "backend": backend_for(ctx.device.type),
            "init_seconds": round(init_s, 3),
            "checks": results,
        }
        print(RESULT_PREFIX + json.dumps(summary), flush=True)
    shutdown(ctx)
    return 0


if __name__ == "__main__":
    exit_now(main())  # the FSDP2 check leaves gloo threads that must not see teardown


# The launcher's side: start the workers above through torchrun and read what they said.


def smoke_command(collective_timeout_s: float) -> list[str]:
    """torchrun on this node, NPROC workers running this module (keel's own launch flags).

    `--standalone` makes torchrun bind its rendezvous store to port 0, i.e. a free port
    the kernel picks, so the test never collides with a job on 29500 and has no race
    between finding a port and using it.
    """
    args = torchrun_args(
        LaunchSpec(nproc=NPROC),
        worker_args=["--timeout", f"{collective_timeout_s:g}"],
        module=MODULE,
    )
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _stop(proc: subprocess.Popen) -> None:
    """End torchrun and its workers (their own session, so only what we started)."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _failure_reason(err: str, returncode: int, timed_out: bool, timeout_s: float) -> str:
    said = list(
        dict.fromkeys(
            line.split("keel-smoke: ", 1)[1]
            for line in err.splitlines()
            if line.startswith("keel-smoke: ")
        )
    )
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", err, re.S)
    if timed_out:
        head = (
            f"timed out after {timeout_s:g} s: a process hung (at start-up or in a "
            "collective) and was stopped"
        )
    else:
        head = f"torchrun exited with code {returncode}"
        if root:
            head += f"; first failure: rank {root.group(1)} exited with code {root.group(2)}"
    return "; ".join([head, *said]) if said else head + " (no message from the workers)"


def launch_smoke_test(
    *,
    timeout_s: float,
    collective_timeout_s: float,
    gpus: int,
    environ: Mapping[str, str] | None = None,
) -> dict:
    """Run the checks in NPROC processes through torchrun; never raises.

    `environ` None: the process's environment at this call. Not bound as the default at
    import: `datasets`' map with num_proc > 1 rebinds `os.environ` to a new object, and a
    bound default would miss what was set since (keel.faults reads it the same way).

    Returns {"ok", "seconds", "detail", "processes", "checks"} plus "stderr_tail" on a
    failure. With one GPU the workers run on the CPU (keel gives each process its own GPU,
    so two cannot share one) and the detail says CUDA collectives were not tested.
    """
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k not in TORCHRUN_VARS}  # a job of its own
    env["OMP_NUM_THREADS"] = "1"
    untested = ""
    if gpus == 1:
        env["CUDA_VISIBLE_DEVICES"] = ""
        untested = "; CUDA collectives not tested: 1 GPU, and keel runs one process per GPU"
    start = time.monotonic()
    proc = subprocess.Popen(
        smoke_command(collective_timeout_s),
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
        out, err = proc.communicate()
    seconds = round(time.monotonic() - start, 2)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None
    if result is not None and proc.returncode == 0 and not timed_out:
        steps = "; ".join(f"{c['detail']} ({c['seconds'] * 1000:.0f} ms)" for c in result["checks"])
        detail = (
            f"{result['world_size']} processes via torchrun, backend "
            f"{result['backend']} on {result['device']}: {steps}; "
            f"{seconds:.1f} s in all, start-up included{untested}"
        )
        return {
            "ok": True,
            "seconds": seconds,
            "detail": detail,
            "processes": result["world_size"],
            "checks": result["checks"],
        }
    return {
        "ok": False,
        "seconds": seconds,
        "processes": NPROC,
        "checks": [],
        "detail": _failure_reason(err, proc.returncode, timed_out, timeout_s),
        "stderr_tail": err[-STDERR_TAIL_CHARS:],
    }
