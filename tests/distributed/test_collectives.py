"""Process-group behaviour under torchrun with gloo: object collectives in every strategy."""

import json
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("collectives_worker.py")


def test_object_collectives_work_in_every_strategy(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        assert seen["launcher"] == "torchrun"
        for strategy in ("single", "ddp", "fsdp"):
            assert seen[strategy]["broadcast"] == {"from": 0, "strategy": strategy}
            assert seen[strategy]["gathered"] == [0, 10]
            assert seen[strategy]["summed"] == [3.0]
        # The failure keel's backend string prevents, reproduced, and the fix working.
        assert "No backend type associated with device type cpu" in seen["accelerator_only"]
        assert seen["keel_backend"] == 2.0
    # Rank 0 failing while the others wait: they get its message instead of hanging.
    assert ranks[0]["rank0_failure"] == "bad dataset row 7"
    assert (
        ranks[1]["rank0_failure"] == "rank 0 failed while preparing: ValueError: bad dataset row 7"
    )
    assert ranks[1]["on_main_failure"] == "rank 0 failed: KeelError: output.dir is not empty"
    # A rank that prepared other data than rank 0: every rank refuses, naming it
    for seen in ranks:
        assert seen["other_data"].startswith("rank 1 (host "), seen["other_data"]
        assert "prepared other data than rank 0" in seen["other_data"]
