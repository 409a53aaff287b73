"""CPU threads for torch in each training process (`train.threads`), and a warning when the
machine is already busy: threads that wait for a core make every step slower, not faster."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

Log = Callable[[str], None]


def set_threads(requested: int, local_processes: int, log: Log, detail: Log) -> int:
    """Give torch `requested` threads, or (0) this process's share of the cores it may run
    on; warn through `log` when other work already keeps those cores busy."""
    # torchrun sets OMP_NUM_THREADS=1 unless told otherwise; choose deliberately instead.
    cores = len(os.sched_getaffinity(0))
    threads = requested or max(1, cores // max(local_processes, 1))
    torch.set_num_threads(threads)
    detail(f"threads: {threads} per process")
    warning = busy_warning(os.getloadavg()[0], threads * local_processes, cores)
    if warning:
        log(f"warning: {warning}")
    return threads


def busy_warning(load: float, planned: int, cores: int) -> str | None:
    """Why `planned` more threads would oversubscribe `cores` at a 1-minute load average of
    `load`, or None. A load under 1 is this command's own start-up, not other work."""
    if load < 1 or load + planned <= cores:
        return None
    fewer = max(1, int(cores - load) if load < cores else 1)
    return (
        f"this machine is busy: load average {load:.1f} on {cores} cores, and this run adds "
        f"{planned} thread(s); threads that wait for a core slow every step. Set "
        f"train.threads={fewer} (threads per process), or train when the machine is idler"
    )
