"""One process of several `keel train` runs made one after another in ONE torchrun launch.

torchrun --nproc-per-node N runs_worker.py PLAN RESULTS

PLAN is a JSON list of keel argvs (["--verbose", "train", "run.yaml", "output.dir=..."]);
each goes through keel.cli.main, as the worker `keel train --nproc N` starts would run it,
and joins a process group of its own. A launch costs the 2-core CI machine ~15 s of
interpreter start and library imports; the runs of a parity test take 1-3 s each.
Rank 0 writes [[exit code, stdout, stderr], ...] to RESULTS, one per run made; the first
run that fails on any rank ends the launch (this rank's exit 1 makes torchrun stop the rest).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli_support import main_captured  # noqa: E402

from keel.distributed.process_group import exit_now  # noqa: E402


def main(plan: Path, results: Path) -> int:
    rank = int(os.environ["RANK"])
    outcomes = []
    for argv in json.loads(plan.read_text()):
        outcomes.append(main_captured(argv))
        if rank == 0:
            results.write_text(json.dumps(outcomes))
        if outcomes[-1][0] != 0:
            sys.stderr.write(f"rank {rank}: {argv} exited {outcomes[-1][0]}\n{outcomes[-1][2]}")
            return 1
    return 0


if __name__ == "__main__":
    # As keel's own workers end: without interpreter teardown (gloo threads of FSDP2's
    # cached meshes still run; see exit_now).
    exit_now(main(Path(sys.argv[1]), Path(sys.argv[2])))
