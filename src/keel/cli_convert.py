"""`keel convert` and the mapping report of a LLaMA-Factory or Axolotl config (split from
cli.py, which registers and calls these; like cli.py: parse, then call, no logic)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from keel.errors import ConfigError

if TYPE_CHECKING:
    from keel.config.dialects import Translation


def add_convert(sub) -> None:
    convert = sub.add_parser(
        "convert",
        help="translate a LLaMA-Factory or Axolotl config into a keel config (with its "
        "mapping report as comments)",
    )
    convert.add_argument("config", help="their YAML config")
    convert.add_argument(
        "--out", required=True, help="the keel YAML to write; keel never overwrites a file"
    )


def mapping_report(source: str | Path, translation: Translation) -> str:
    """Which dialect `source` was read as, then how each of its keys was read."""
    return f"{source}: {translation.report()}"


def show_translation(source: str | Path, log: Callable[[str], None]) -> Callable:
    """A `load_config(on_translation=...)` hook that shows the mapping report with `log`."""
    return lambda translation: log(mapping_report(source, translation))


def run_convert(args) -> int:
    """Write `args.config` translated to keel's YAML at `args.out`; refuse an existing
    --out and a config that is keel's already."""
    from keel.config import load_config

    out = Path(args.out)
    if out.exists():
        raise ConfigError(
            [f"--out {out} exists; keel never overwrites a file: name a new file or move it"]
        )
    found: list[Translation] = []
    # the same loading as `keel train THEIR.yaml`: the report first, then every problem
    load_config(args.config, on_translation=_kept_and_shown(args.config, found))
    if not found:
        raise ConfigError(
            [
                f"{args.config} is a keel config already: nothing to convert "
                f"(`keel validate {args.config}` checks it)"
            ]
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("x", encoding="utf-8") as file:  # "x": never replace a file made meanwhile
        file.write(converted_yaml(mapping_report(args.config, found[0]), found[0].config))
    print(f"wrote {out}; check it with: keel validate {out}")
    return 0


def _kept_and_shown(source: str, found: list) -> Callable:
    def hook(translation: Translation) -> None:
        found.append(translation)
        print(mapping_report(source, translation))

    return hook


def converted_yaml(report: str, config: dict) -> str:
    """The keel config as YAML, under the mapping report as comments."""
    header = [
        "# Written by `keel convert`: the mapping report of the config it came from.",
        *(f"# {line}".rstrip() for line in report.splitlines()),
    ]
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return "\n".join(header) + "\n\n" + body
