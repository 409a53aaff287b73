"""What the demos (benchmarks/*_demo.py) share on their command line: the --readme and --set
options, and their shipped config loaded for a fresh run with the user's overrides."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_demo_options(parser: argparse.ArgumentParser, set_example: str) -> None:
    """--readme (the markdown section's file) and --set (repeatable config overrides, as
    `keel train` takes them; `set_example` shows one in the help)."""
    parser.add_argument("--readme", help="also write the markdown section to this file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override the config, as `keel train` does (e.g. {set_example})",
    )


def fresh_run_config(config: Path, overrides: list[str], run_dir: Path, *placed: str):
    """`config` with the user's `overrides`, then the demo's own `placed` ones, training
    afresh into `run_dir`. Never resumed: with resume=auto a finished run there would be
    "resumed" at its last step and train nothing, even after the config changed."""
    from keel.config import load_config

    fresh = [f"output.dir={run_dir}", "output.overwrite=true", "train.resume=never"]
    return load_config(config, [*overrides, *placed, *fresh])
