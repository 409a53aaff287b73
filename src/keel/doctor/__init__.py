"""`keel doctor`: can this machine train? Checked before a job is submitted, not after it dies.

It reports versions, devices (memory, bf16 measured as `precision: auto` measures it),
the distributed backends, /dev/shm, and runs a real 2-process job through torchrun
(keel.distributed.smoke: keel's own process group, all_reduce on every device type,
object broadcast, barrier and one FSDP2 step checked against an unsharded step).

Each finding is a *problem* (training needs it and it is broken) or a *note* (worth knowing,
training still works):

  problem  a keel dependency missing, outside keel's declared range (e.g. transformers < 5),
           or failing to import (a peft/transformers pair that does not fit shows here)
  problem  torch without torch.distributed, without gloo, or with GPUs but without NCCL
  problem  NVIDIA GPUs on the machine that torch cannot use (CPU-only build, old driver)
  problem  a CUDA device that fails a tiny bf16 (or fp32) matmul
  problem  keel's process-group backend string without a CPU backend (field note 1)
  problem  the 2-process smoke test failed or timed out (what failed, and the stderr tail)
  problem  /dev/shm under 1 GiB with 2+ GPUs (NCCL keeps its buffers there); a note otherwise
  note     bf16 slow on this CPU (auto picks fp32), or only emulated on a GPU
  note     an optional package (flash_attn, bitsandbytes) installed but failing to import
  note     OMP_NUM_THREADS=1 in the environment; 1 GPU (CUDA collectives need 2, not tested)

Exit code: 0 when there is no problem, 1 when at least one (each listed); 2 is left to
usage errors, as everywhere in keel.

Test hook: `KEEL_FAULT` (keel.faults) is passed on to the smoke test's workers, where
`KEEL_FAULT=exit:<check>:<rank>` (or hang / stall) fires at the start of that numbered
check (see keel.distributed.smoke), so tests can make the smoke test fail for real.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable

from keel.doctor.machine import (
    backends,
    cpu_device,
    cuda_devices,
    environment_notes,
    shared_memory,
)
from keel.doctor.packages import check_imports, check_requirements, collect_versions
from keel.doctor.report import Report, render

__all__ = ["Report", "diagnose", "render", "run_doctor"]

# The whole doctor must answer within a minute on a CPU; the smoke test usually takes 5 s.
SMOKE_TIMEOUT_S = 40.0
COLLECTIVE_TIMEOUT_S = 20.0

Log = Callable[[str], None]


def smoke_test(report: Report, gpus: int, *, timeout_s: float = SMOKE_TIMEOUT_S) -> None:
    """The real thing: keel's process group in 2 processes through torchrun."""
    if not (report.backends.get("distributed") and report.backends.get("gloo")):
        report.smoke_test = {
            "ok": False,
            "seconds": 0.0,
            "detail": "not run: this torch has no torch.distributed / gloo",
        }
        return
    from keel.distributed.smoke import launch_smoke_test

    report.smoke_test = launch_smoke_test(
        timeout_s=timeout_s, gpus=gpus, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )
    if gpus == 1:
        report.notes.append(
            "1 GPU: the smoke test ran its 2 processes on the CPU (keel runs one process per "
            "GPU), so NCCL itself was not exercised"
        )
    if not report.smoke_test["ok"]:
        report.problems.append(
            f"the {report.smoke_test['processes']}-process smoke test "
            f"failed: {report.smoke_test['detail']}"
        )


def diagnose(
    *,
    cpu_bf16_speedup: Callable[[], tuple[float, float]],
    log: Log,
    smoke_timeout_s: float = SMOKE_TIMEOUT_S,
) -> Report:
    """Run every check; `cpu_bf16_speedup` is the probe `precision: auto` uses
    (keel.precision.cpu_bf16_speedup), passed in so that a test can give a fixed one."""
    started = time.monotonic()
    report = Report()
    log("keel doctor: versions and imports ...")
    collect_versions(report)
    check_requirements(report)
    check_imports(report)
    log("keel doctor: devices (a bf16 and an fp32 matmul on each) ...")
    cpu_device(report, cpu_bf16_speedup)
    cuda_devices(report)
    gpus = sum(d["type"] == "cuda" for d in report.devices)
    backends(report)
    shared_memory(report, gpus)
    environment_notes(report)
    cpu = report.devices[0]
    if not cpu["bf16"] and not gpus:
        report.notes.append(
            f"bf16 is slow on this CPU ({cpu['bf16_gflops']:g} GFLOP/s vs fp32 "
            f"{cpu['fp32_gflops']:g}): `precision: auto` trains in fp32 here"
        )
    log("keel doctor: 2-process smoke test through torchrun ...")
    smoke_test(report, gpus, timeout_s=smoke_timeout_s)
    report.seconds = time.monotonic() - started
    return report


def run_doctor(*, as_json: bool, cpu_bf16_speedup: Callable[[], tuple[float, float]]) -> int:
    """`keel doctor [--json]`: print the report; 0 when training can work, 1 when not.

    With `as_json`, stdout gets exactly one JSON document; everything else goes to stderr.
    """

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # Nothing a library prints while being checked may land in the JSON document.
    with contextlib.redirect_stdout(sys.stderr):
        report = diagnose(cpu_bf16_speedup=cpu_bf16_speedup, log=log)
    print(json.dumps(report.to_json(), indent=1) if as_json else render(report), flush=True)
    return 0 if report.ok else 1
