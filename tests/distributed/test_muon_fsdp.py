"""train.optimizer muon under FSDP2: a process holding some rows of a matrix steps them
exactly as one process steps the whole matrix (each update is gathered and orthogonalised
whole), for rows that do not split evenly and for a fused experts weight."""

import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("muon_worker.py")


def test_row_shards_step_as_the_whole_matrix(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    seen = torch.load(tmp_path / "muon.pt")
    for name, whole in seen["whole"].items():
        torch.testing.assert_close(seen["sharded"][name], whole, rtol=0, atol=0, msg=name)
    # negative control: orthogonalising each process's rows alone is another update
    assert (seen["per_shard"] - seen["orthogonalised"]).abs().max() > 0.1
