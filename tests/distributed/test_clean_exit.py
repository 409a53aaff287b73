"""A finished `keel train --nproc 2` worker never goes through interpreter teardown with
gloo's threads still running.

FSDP2 and DTensor cache their DeviceMesh, and with it the gloo process group, for the life
of the process, so destroy_process_group() leaves gloo's threads running. A worker that then
went through Python's and the C++ runtime's teardown was ended by SIGABRT ("terminate called
without an active exception") under load, after a run that had succeeded. The probe: a
sitecustomize on every process's path records, at interpreter exit, the threads still alive.
"""

from __future__ import annotations

import sys

import pytest
from multiproc import Workspace

PROBE = """
import atexit, os

def _threads_at_exit():
    tasks = f"/proc/{os.getpid()}/task"
    names = [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)]
    with open(os.path.join(FOLDER, f"{os.getpid()}.txt"), "w") as f:
        f.write("\\n".join(names))

atexit.register(_threads_at_exit)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fsdp_workers_skip_teardown_with_live_gloo_threads(tmp_path, tiny_model_dir, monkeypatch):
    probe, seen = tmp_path / "probe", tmp_path / "threads"
    probe.mkdir()
    seen.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE.replace("FOLDER", repr(str(seen))))
    monkeypatch.setenv("PYTHONPATH", str(probe))
    workspace = Workspace(tmp_path, tiny_model_dir)
    workspace.train(
        "out",
        "distributed.strategy=fsdp",
        "train.max_steps=2",
        "output.save_every=0",
        nproc=2,
    )
    at_exit = {path.stem: path.read_text().split() for path in seen.iterdir()}
    assert at_exit, "the probe never ran (the launcher itself exits normally)"
    with_gloo = {pid: names for pid, names in at_exit.items() if any("gloo" in n for n in names)}
    assert not with_gloo, f"processes tore down with gloo threads alive: {with_gloo}"
