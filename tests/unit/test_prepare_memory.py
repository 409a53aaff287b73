"""The memory watchdog covers data preparation as it covers training steps: resident memory
over the process's share there ends the run with exit 3 naming the phase, where before the
kernel's OOM killer ended it without a word (one 200 MB JSONL row: 16.5 GB)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from keel.distributed import watchdog as watchdog_module
from keel.distributed.watchdog import Watchdog, WatchdogSettings

ROOT = Path(__file__).resolve().parents[2]


def dog(tmp_path, **limits) -> Watchdog:
    settings = WatchdogSettings(
        hang_timeout_s=60.0,
        stall_timeout_s=None,
        on_stall="warn",
        diagnostics_dir=tmp_path / "diagnostics",
        **limits,
    )
    return Watchdog(settings, rank=0, world_size=1)


def test_over_the_limit_in_data_preparation_exits_3_naming_the_phase(tmp_path, monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(watchdog_module.os, "_exit", exits.append)
    watched = dog(tmp_path, host_rss_limit_bytes=1)
    watched._check_memory()  # no phase under the memory check: nothing
    with watched.progress.phase("prepare", None):
        watched._check_memory()
        assert exits == []
        with watched.progress.memory_watched("data preparation"):
            watched._check_memory()
    assert exits == [3]
    err = capsys.readouterr().err
    assert "out of memory on rank 0 during data preparation: resident memory" in err
    assert "data.max_row_bytes" in err


def test_in_a_step_the_main_thread_is_told_instead(tmp_path, monkeypatch):
    exits = []
    monkeypatch.setattr(watchdog_module.os, "_exit", exits.append)
    watched = dog(tmp_path, rss_limit_bytes=1, host_rss_limit_bytes=10**15)
    with watched.progress.memory_watched("data preparation"):
        watched.progress.step_begin(1)
        watched._check_memory()
    assert exits == [] and watched.rss_exceeded is not None


HARNESS = """
import functools, sys
import keel.train.watch as watch
# a limit any process is over, checked every 50 ms (the tokenizing below takes seconds)
watch.host_rss_limit = lambda dist: 1
watch.WatchdogSettings = functools.partial(watch.WatchdogSettings, interval_s=0.05)
from keel.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_keel_train_over_the_limit_while_preparing_data_exits_3(tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    row = {"instruction": "Who are you?", "input": "", "output": "I am Keel."}
    data.write_text("".join(json.dumps({**row, "input": str(i)}) + "\n" for i in range(4000)))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(HARNESS),
            "train",
            str(ROOT / "examples" / "identity_lora.yaml"),
            f"model.path={tiny_model_dir}",
            f"model.cache_dir={tmp_path / 'cache'}",
            f"data.datasets.0.path={data}",
            f"output.dir={tmp_path / 'out'}",
            "train.threads=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "out of memory on rank 0 during data preparation" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
