"""Output folders through the CLI: a second run into a busy folder, an output.dir that is a
file, reruns of a shipped example, and SIGTERM in the middle of `keel export`. The busy
folder and the signal need real processes; the other commands go through keel.cli.main in
the test process (what the program runs, without an interpreter start per command)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from cli_support import ROOT, keel, keel_in_process

from keel.config import load_config
from keel.train.output_folder import LOCK
from keel.train.run import run_training


def train_flags(model_dir: Path, tmp_path: Path, out: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"output.dir={out}",
        "train.max_steps=2",
        "train.precision=fp32",
        "train.threads=1",
    ]


def test_a_second_train_into_a_busy_folder_exits_2_naming_the_first(
    tiny_model_dir, data_file, tmp_path
):
    """While a run is between its steps, `keel train` into its folder is refused before it
    touches anything, and the first run ends with a consistent folder."""
    out = tmp_path / "run"
    overrides = [
        f"data.datasets=[{data_file}]",
        "data.cutoff_len=64",
        "method.type=lora",
        "output.save_every=1",
        "watchdog.enabled=false",  # the pause below is the test's, not a stall
    ]
    config_file = tmp_path / "run.yaml"
    config_file.write_text("output:\n  overwrite: true\n")
    flags = [*train_flags(tiny_model_dir, tmp_path, out), *overrides]
    second = {}

    def start_the_second(step, _record):
        if step == 1:
            second["result"] = keel("train", str(config_file), *flags, "train.seed=7")

    cfg = load_config(str(config_file), flags)
    run_training(cfg, log=lambda _line: None, on_step_end=start_the_second)
    refused = second["result"]
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"in use by another keel run (pid {os.getpid()} on" in refused.stderr
    assert "Traceback" not in refused.stderr and "model ready" not in refused.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["seed"] == cfg.train.seed != 7  # the first run's config
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert (out / "keel_run.json").is_file() and not (out / LOCK).exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000001",
        "step-00000002",
    ]


def test_output_dir_that_is_a_file_exits_2_before_loading(tiny_model_dir, tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("my results")
    for out in (a_file, a_file / "run"):
        done = keel_in_process(
            "train", "examples/identity_lora.yaml", *train_flags(tiny_model_dir, tmp_path, out)
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert "is a file, not a folder" in done.stderr and "Traceback" not in done.stderr
        assert "model ready" not in done.stdout and "model:" not in done.stdout
    assert a_file.read_text() == "my results"


def test_rerunning_the_demo_into_its_folder_works_and_spares_foreign_files(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "demo"
    flags = [*train_flags(tiny_model_dir, tmp_path, out), "train.resume=never"]
    for _ in range(2):
        done = keel_in_process("train", "examples/identity_lora.yaml", *flags)
        assert done.returncode == 0, done.stderr[-3000:]
    assert f"output.overwrite: removing {out / 'keel_run.json'}" in done.stdout
    (out / "my_eval.py").write_text("print('mine')\n")
    refused = keel_in_process("train", "examples/identity_lora.yaml", *flags)
    assert refused.returncode == 2 and f"{out / 'my_eval.py'}" in refused.stderr
    assert (out / "my_eval.py").read_text() == "print('mine')\n"
    assert (out / "keel_run.json").is_file()


# `keel export` whose writing pauses (inside the temporary folder) until it is signalled.
# It pauses in short sleeps, as real writing runs Python between its calls: Python runs a
# handler in the main thread at its next instruction, and one sleep(300) would not end early
# when the kernel hands the signal to another of the process's threads (a CI flake).
PAUSED_EXPORT = """
import sys, time
import keel.export.write as export
real = export.add_legacy_keys
def paused(folder):
    real(folder)
    print("writing", flush=True)
    for _ in range(3000):
        time.sleep(0.1)
export.add_legacy_keys = paused
from keel.cli import main
sys.exit(main(["export", "--model", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_sigterm_during_export_leaves_no_partial_folder(tiny_model_dir, tmp_path):
    out = tmp_path / "exported"
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSED_EXPORT, str(tiny_model_dir), str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stdout:
            if line.strip() == "writing":
                break
        partials = [p for p in tmp_path.iterdir() if p.name.startswith(".exported.partial-")]
        assert len(partials) == 1 and any(partials[0].iterdir())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    again = keel_in_process("export", "--model", str(tiny_model_dir), "--out", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "config.json").is_file()
