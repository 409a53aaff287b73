"""The `keel` command as the e2e tests run it.

- `keel`: the real program in a subprocess, as a user runs it (pipes, as in `keel train ...
  > log`), for what only a process shows: its exit status, signals, what reaches a pipe.
- `keel_in_process`: `keel.cli.main(argv)` in the test's own process, for what a command
  decides and prints. A subprocess pays the interpreter and the torch/transformers imports
  again (5-10 s on the 2-core CI machine); main is what the program runs, and its return
  value is the program's exit status (`keel.cli.entry`).
- `keel_commands`: several commands through main in ONE new interpreter, for tests whose
  environment must be set before the libraries are imported (huggingface_hub reads HF_HOME
  and HF_HUB_OFFLINE at import).
- `run_demo`: a demo script of benchmarks/ run whole, as `make demo-*` runs it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def keel(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """`python -m keel *args` with stdout and stderr captured as text (pipes, as in
    `keel train ... > log`); `env` defaults to this process's, unbuffered."""
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        cwd=cwd,
        env=env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def keel_in_process(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`keel *args` through keel.cli.main in this process, run from `cwd`: its exit code,
    stdout and stderr. An exception that escapes main is printed to stderr with code 1, as
    the program prints it; torch's thread count (train.threads sets it for the whole
    process) is put back afterwards."""
    import torch

    threads, previous = torch.get_num_threads(), Path.cwd()
    os.chdir(cwd)
    try:
        code, out, err = main_captured(list(args))
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["keel", *args], code, out, err)


def keel_commands(
    *commands: Sequence[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 600
) -> list[subprocess.CompletedProcess[str]]:
    """Each of `commands` (a keel argv) through keel.cli.main, in order, in one new
    interpreter with environment `env`: one result per command, as `keel_in_process`."""
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder, "results.json")
        argvs = json.dumps([list(command) for command in commands])
        done = subprocess.run(
            [sys.executable, __file__, str(results), argvs],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes = json.loads(results.read_text())
    return [
        subprocess.CompletedProcess(["keel", *command], code, out, err)
        for command, (code, out, err) in zip(commands, outcomes, strict=True)
    ]


def run_demo(script: str, out: Path, cache_dir: Path) -> dict:
    """`python benchmarks/<script> --out <out>` with the bundled model's cache at `cache_dir`
    (an hour at most); it must succeed. The results.json it wrote into `out`."""
    command = [sys.executable, f"benchmarks/{script}", "--out", str(out)]
    done = subprocess.run(
        [*command, f"--set=model.cache_dir={cache_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def main_captured(argv: list[str]) -> tuple[int, str, str]:
    """keel.cli.main(argv) in this process: (exit code, stdout, stderr), as the program
    would end and print."""
    from keel.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except Exception:
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


if __name__ == "__main__":  # keel_commands' interpreter: results file, then the argvs
    outcomes = [main_captured(argv) for argv in json.loads(sys.argv[2])]
    Path(sys.argv[1]).write_text(json.dumps(outcomes))
