"""The real `keel` command in a subprocess, as a user runs it (the e2e tests' entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
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
