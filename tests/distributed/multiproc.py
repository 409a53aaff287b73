"""Multi-process runs, launched the way users launch them: `keel train cfg.yaml --nproc 2`.
The one-process runs they are compared with go through keel.cli.main in the test process:
the same training, without an interpreter start and the library imports for each. Parity
tests that only compare numbers make their multi-process runs together, in one torchrun
launch (`Workspace.train_together`): each launch costs ~15 s of imports on the 2-core CI
machine, a tiny run 1-3 s.

Every run uses the same tiny model, an 11-row dataset and a global batch of 5 rows, so the
last step of an epoch holds one row: with 2 processes, one of them runs filler micro-batches
(the uneven remainder that hangs other tools).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml
from cli_support import keel_in_process
from conftest import QA

ROWS = 12  # 11 train rows after holding one out for eval
# (prompt, chosen, rejected) for the preference and reward-model runs: ROWS of them (11 to
# train on), of different lengths, so each rank pads its batch to lengths of its own
PREFERENCE_PAIRS = [
    ("Who are you?", "I am Keel, a small assistant.", "No."),
    ("What is your name?", "My name is Keel.", "Why do you ask me that question?"),
    ("Add 2 and 3.", "5", "It is 6 or maybe 7, I am not sure."),
    ("Say hello in French.", "Bonjour.", "Hello."),
    ("Give a healthy tip.", "Sleep enough and move every day.", "Eat cake."),
    ("Name a color.", "Blue.", "A number."),
    ("What is 3 times 4?", "12", "34"),
    ("Are you ChatGPT?", "No, I am Keel.", "Yes."),
    ("Translate to French: hello world.", "Bonjour le monde.", "Hola mundo, amigo mio."),
    ("Count to three.", "1, 2, 3.", "3"),
    ("What comes after Monday?", "Tuesday.", "Sunday, then Friday."),
    ("Is the sky blue?", "Yes, on a clear day.", "Never."),
]

RUN_TIMEOUT_S = 240  # a hang fails the test instead of the CI job
RUNS_WORKER = Path(__file__).with_name("runs_worker.py")


def base_config(model_dir: Path, data: Path, cache: Path) -> dict:
    return {
        "model": {"path": str(model_dir), "cache_dir": str(cache)},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data)], "cutoff_len": 128, "val_size": 1},
        "train": {
            "max_steps": 6,
            "micro_batch_size": 2,
            "global_batch_size": 5,
            "lr": 1e-2,
            "scheduler": "constant",
            "precision": "fp32",
            "threads": 1,
        },
        "output": {"dir": "unused", "save_every": 2, "keep_last": 3},
    }


class Workspace:
    """A model, a dataset and a config on disk, and a way to run keel on them."""

    def __init__(self, root: Path, model_dir: Path):
        self.root = root
        data = root / "qa.json"
        rows = [{"instruction": q, "input": "", "output": a} for q, a in QA * 2][:ROWS]
        data.write_text(json.dumps(rows))
        self.config = root / "run.yaml"
        self.config.write_text(yaml.safe_dump(base_config(model_dir, data, root / "cache")))

    def train(self, out: str, *overrides: str, nproc: int | None = None) -> Path:
        """Run `keel train` to completion (`nproc` processes under torchrun, or one: this
        process); returns output.dir."""
        args = self.command(out, *overrides)
        if nproc is None:
            done = keel_in_process(*self.keel_argv(out, *overrides), cwd=self.root)
        else:
            args += ["--nproc", str(nproc)]
            done = subprocess.run(
                args,
                cwd=self.root,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                env=_env(),
            )
        assert done.returncode == 0, f"{' '.join(args)}\n{done.stderr[-4000:]}"
        self.last_output = done.stdout + done.stderr
        return self.root / out

    def train_together(self, runs: Iterable[tuple[str, tuple[str, ...]]]) -> dict[str, Path]:
        """Each of `runs` (output.dir under root, overrides), in order, as the workers of
        `keel train --nproc 2` run it, all in ONE torchrun launch (runs_worker.py); returns
        output.dir by name, and keeps rank 0's output of each name's last run in
        `outputs_together`. The launch ends at the first run that fails, and so does the test.
        """
        runs = list(runs)
        plan, results = self.root / "plan.json", self.root / "results.json"
        plan.write_text(json.dumps([self.keel_argv(out, *args) for out, args in runs]))
        results.unlink(missing_ok=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", str(RUNS_WORKER), str(plan), str(results)]
        done = subprocess.run(
            command,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S + 30 * len(runs),
            env=_env(),
        )
        assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr[-4000:]}"
        outcomes = json.loads(results.read_text())
        assert len(outcomes) == len(runs)
        self.outputs_together = {out: o[1] + o[2] for (out, _), o in zip(runs, outcomes)}
        return {out: self.root / out for out, _ in runs}

    def train_cases_together(self, cases: dict[str, tuple[str, tuple[str, ...]]]):
        """`train_together` for cases named by their output.dir: name -> (strategy,
        overrides), each run under distributed.strategy=strategy."""
        return self.train_together(case_runs(cases))

    def command(self, out: str | Path, *args: str) -> list[str]:
        """The `keel train` command line for this config into output.dir `out` (a folder
        under root), then `args`: overrides and flags."""
        return [sys.executable, "-m", "keel", *self.keel_argv(out, *args)]

    def keel_argv(self, out: str | Path, *args: str) -> list[str]:
        """`command`'s arguments after `keel`. With --verbose: tests read the technical
        set-up lines (optimizer layout, strategy, resume)."""
        return ["--verbose", "train", str(self.config), f"output.dir={self.root / out}", *args]


def case_runs(cases: dict[str, tuple[str, tuple[str, ...]]]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, overrides) of each case named by its output.dir: name -> (strategy, overrides),
    run under distributed.strategy=strategy (what `Workspace.train_together` takes)."""
    return [
        (name, (*overrides, f"distributed.strategy={strategy}"))
        for name, (strategy, overrides) in cases.items()
    ]


def single_process_runs(workspace: Workspace):
    """`run(*overrides) -> output.dir`: the single-process run of each distinct set of
    overrides, trained once and shared by every test of the module that compares with it
    (a module-scoped `reference` fixture returns this)."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> Path:
        if overrides not in runs:
            runs[overrides] = workspace.train(f"single-{len(runs)}", *overrides)
        return runs[overrides]

    return run


def free_port() -> int:
    """A TCP port no process listens on now (for a test's own process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    return env


def train_losses(out: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl (a resumed run's file reads as one run)."""
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def eval_losses(out: Path) -> dict[int, float]:
    return {
        r["step"]: r["eval_loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in r
    }


def step_records(out: Path) -> dict[int, dict]:
    """step -> that training step's line of metrics.jsonl (the lines with a loss)."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


def assert_same_last_eval_loss(got: Path, want: Path, rel: float) -> None:
    """Run `got` evaluated at least once, and its last eval loss is `want`'s to `rel`."""
    mine, theirs = list(eval_losses(got).values()), list(eval_losses(want).values())
    assert mine and mine[-1] == pytest.approx(theirs[-1], rel=rel)
