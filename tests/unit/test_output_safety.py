"""keel deletes and writes only what it made: marked output folders, refused foreign content,
the run's lock on its folder, unwritable output.dir, and export's temporary folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.config import load_config
from keel.errors import KeelError
from keel.export import ExportRequest, export_model
from keel.export.partial_folder import PARTIAL_MARKER
from keel.owner import Owner
from keel.train import run as run_module
from keel.train.output_folder import LOCK, MARKER, unwritable_reason
from keel.train.run import run_training


def config(model_dir, data_file, out, *overrides):
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(out.parent / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data_file)], "cutoff_len": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "precision": "fp32", "threads": 1},
        "output": {"dir": str(out), "save_every": 1, "overwrite": True},
    }
    return load_config(None, list(overrides), base=base)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under root: a file's bytes, None for a folder."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def never_loads(monkeypatch):
    """Fails the test if training gets as far as loading the model."""
    loads = []

    def refuse(*args, **kwargs):
        loads.append(args)
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_module, "build_training_model", refuse)
    return loads


def train(cfg) -> list[str]:
    lines: list[str] = []
    run_training(cfg, log=lines.append)
    return lines


def project_folder(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src/main.py").write_text("print('my project')\n")
    (root / "README.md").write_text("# my project\n")
    (root / "config.yaml").write_text("mine: true\n")
    (root / "data.csv").write_bytes(b"a,b\n1,2\n")
    return root


def test_overwrite_refuses_a_project_folder_and_leaves_it_intact(
    tiny_model_dir, data_file, tmp_path, never_loads
):
    out = project_folder(tmp_path / "project")
    before = snapshot(out)
    with pytest.raises(KeelError, match="not made by keel") as refused:
        train(config(tiny_model_dir, data_file, out))
    assert str(out / "README.md") in str(refused.value)  # names a foreign file
    assert snapshot(out) == before
    assert never_loads == []


@pytest.mark.parametrize("overwrite", ["true", "false"])
def test_a_users_config_yaml_is_not_an_unfinished_run(
    tiny_model_dir, data_file, tmp_path, never_loads, overwrite
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("# my own notes, not keel's\n")
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(out)
    with pytest.raises(KeelError, match="config.yaml|metrics.jsonl"):
        train(config(tiny_model_dir, data_file, out, f"output.overwrite={overwrite}"))
    assert snapshot(out) == before


def test_rerun_into_its_own_folder_removes_only_keel_files(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    train(config(tiny_model_dir, data_file, out))
    assert (out / MARKER).is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / LOCK).exists()  # released
    marker = json.loads((out / MARKER).read_text())
    assert "adapter_model.safetensors" in marker["written"]
    lines = train(config(tiny_model_dir, data_file, out, "train.resume=never"))
    removed = [line for line in lines if line.startswith("output.overwrite: removing")]
    assert f"output.overwrite: removing {out / 'checkpoints'}" in removed
    assert f"output.overwrite: removing {out / 'adapter_model.safetensors'}" in removed
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]  # not appended to


def test_a_foreign_file_in_a_keel_folder_stops_the_overwrite(
    tiny_model_dir, data_file, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    train(config(tiny_model_dir, data_file, out))
    (out / "notes.txt").write_text("my notes on this run")
    before = snapshot(out)
    monkeypatch.setattr(run_module, "build_training_model", None)  # never reached
    with pytest.raises(KeelError, match="notes.txt, which keel did not write"):
        train(config(tiny_model_dir, data_file, out))
    assert snapshot(out) == before


def test_an_older_keels_output_is_recognised(tiny_model_dir, data_file, tmp_path):
    """A finished run of a keel without the marker (keel_run.json, config.yaml, checkpoints,
    adapter files) is adopted; the same folder with a user's file is refused."""
    out = tmp_path / "old"
    train(config(tiny_model_dir, data_file, out))
    (out / MARKER).unlink()
    (out / "my.txt").write_text("x")
    before = snapshot(out)
    with pytest.raises(KeelError, match="my.txt"):
        train(config(tiny_model_dir, data_file, out))
    assert snapshot(out) == before  # not even marked
    (out / "my.txt").unlink()
    lines = train(config(tiny_model_dir, data_file, out))
    assert any("written by an older keel" in line for line in lines)
    assert (out / MARKER).is_file() and (out / "keel_run.json").is_file()


def hold_lock(out: Path) -> subprocess.Popen:
    """A live process holding keel's lock on `out` until its stdin closes."""
    script = (
        "import sys; from pathlib import Path; from keel.train.output_folder import OutputLock;"
        "lock = OutputLock(Path(sys.argv[1])); lock.acquire(print); print('locked', flush=True);"
        "sys.stdin.read(); lock.release()"
    )
    helper = subprocess.Popen(
        [sys.executable, "-c", script, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert helper.stdout.readline().strip() == "locked"
    return helper


def test_a_second_run_is_refused_naming_the_holder(
    tiny_model_dir, data_file, tmp_path, monkeypatch
):
    out = tmp_path / "busy"
    train(config(tiny_model_dir, data_file, out))
    before = snapshot(out)
    helper = hold_lock(out)
    try:
        monkeypatch.setattr(run_module, "build_training_model", None)  # never reached
        with pytest.raises(KeelError, match=f"in use by another keel run \\(pid {helper.pid} on"):
            train(config(tiny_model_dir, data_file, out))
        assert {k: v for k, v in snapshot(out).items() if k != LOCK} == before
    finally:
        helper.stdin.close()
        helper.wait(timeout=60)
    assert not (out / LOCK).exists()


def test_a_lock_naming_a_live_process_is_respected(tiny_model_dir, data_file, tmp_path):
    """Even without the flock (a file written by another tool or copied), a live pid on this
    host holds the folder."""
    out = tmp_path / "busy"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        owner = Owner(pid=alive.pid, host=socket.gethostname(), since="2024-01-01T00:00:00")
        (out / LOCK).write_text(owner.to_json())
        with pytest.raises(KeelError, match=f"pid {alive.pid} on .*since 2024-01-01"):
            train(config(tiny_model_dir, data_file, out))
        assert (out / LOCK).read_text() == owner.to_json()
    finally:
        alive.stdin.close()
        alive.wait(timeout=60)


def test_the_lock_of_a_dead_run_is_taken_over(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "stale"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    owner = Owner(pid=dead.pid, host=socket.gethostname(), since="2024-01-01T00:00:00")
    (out / LOCK).write_text(owner.to_json())
    lines = train(config(tiny_model_dir, data_file, out, "output.overwrite=false"))
    assert any(
        f"taking over the lock of a keel run that is no longer running (pid {dead.pid}" in line
        for line in lines
    )
    assert (out / "keel_run.json").is_file() and not (out / LOCK).exists()


def test_output_dir_that_is_a_file_is_refused_before_loading(
    tiny_model_dir, data_file, tmp_path, never_loads
):
    a_file = tmp_path / "out.txt"
    a_file.write_text("not a folder")
    with pytest.raises(KeelError, match="is a file, not a folder"):
        train(config(tiny_model_dir, data_file, a_file))
    with pytest.raises(KeelError, match=f"{a_file} is a file, not a folder"):
        train(config(tiny_model_dir, data_file, a_file / "run"))
    assert a_file.read_text() == "not a folder" and never_loads == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_dir_in_a_read_only_folder_is_refused(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert "is not writable" in unwritable_reason(locked / "run")
    finally:
        locked.chmod(0o755)


def test_unwritable_output_dir_is_a_preflight_problem(tiny_model_dir, data_file, tmp_path):
    from keel.errors import ConfigError
    from keel.train.preflight import preflight

    a_file = tmp_path / "taken"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="output.dir .* is a file"):
        preflight(config(tiny_model_dir, data_file, a_file), base_dir=tmp_path, log=print)


def partial(parent: Path, name: str, owner: Owner | None) -> Path:
    folder = parent / f".{name}.partial-{time.monotonic_ns()}"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"half a model")
    if owner is not None:
        (folder / PARTIAL_MARKER).write_text(owner.to_json())
    return folder


def test_the_next_export_removes_the_leftover_of_an_interrupted_one(tiny_model_dir, tmp_path):
    """Only keel's leftovers of a process that has ended: not an unmarked look-alike, not a
    running export's folder, not another target's."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    host = socket.gethostname()
    left = partial(tmp_path, "merged", Owner(dead.pid, host, "2024-01-01T00:00:00"))
    running = partial(tmp_path, "merged", Owner(os.getpid(), host, "2024-01-01T00:00:00"))
    unmarked = partial(tmp_path, "merged", None)
    other = partial(tmp_path, "other", Owner(dead.pid, host, "2024-01-01T00:00:00"))
    lines: list[str] = []
    export_model(ExportRequest(model=str(tiny_model_dir), out=tmp_path / "merged"), lines.append)
    assert (tmp_path / "merged/config.json").is_file()
    assert not left.exists() and running.is_dir() and unmarked.is_dir() and other.is_dir()
    assert any(f"removing {left}" in line and f"pid {dead.pid}" in line for line in lines)
    assert not (tmp_path / "merged" / PARTIAL_MARKER).exists()
