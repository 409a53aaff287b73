"""`keel chat|serve|export CONFIG`: keel's run config (what it trained: its output.dir), a
LLaMA-Factory chat or export config, or an Axolotl training config fills the flags the
command line leaves unset (split from cli.py, which registers and calls these; like cli.py:
parse, then call, no logic)."""

from __future__ import annotations

import sys
from pathlib import Path

from keel.errors import ConfigError

# keel's own defaults for the flags their configs may set, applied after theirs
_DEFAULTS = {
    "chat": {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0},
    "serve": {"backend": "keel"},
    "export": {"max_shard_size": "5GB"},
    "predict": {
        **{"max_new_tokens": 512, "temperature": 0.0, "top_p": 1.0},
        **{"seed": 42, "max_batch_size": 16},
    },
}
_REQUIRED = {
    "chat": ("model",),
    "serve": ("model",),
    "export": ("model", "out"),
    "predict": ("model", "out"),
}


def add_their_config(parser) -> None:
    """The optional config positional, and their `key=value` settings after it."""
    parser.add_argument(
        "config",
        nargs="?",
        help="a config: keel's run config (its output.dir is the model), LLaMA-Factory's chat "
        "or export YAML, or an Axolotl training YAML (flags given here win over it)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="key=value settings of their config, as their CLIs take"
    )


def fill_from_their_config(args, command: str) -> None:
    """Set `args`' unset flags from their config (its mapping report to stderr, a refused key
    stops here), then keel's defaults; ConfigError when a required flag is still unset."""
    if args.config is not None and "=" in args.config and not Path(args.config).is_file():
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.config is not None:
        _fill(args, _settings_of(args, command))
    elif args.overrides:
        raise ConfigError([f"{' '.join(args.overrides)}: settings of a config; name the config"])
    for name, value in _DEFAULTS[command].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if isinstance(getattr(args, "max_shard_size", None), str):
        from keel.config.sizes import parse_memory

        try:
            args.max_shard_size = parse_memory(args.max_shard_size)
        except ValueError as exc:
            raise ConfigError([f"export_size: {exc}"], source=args.config) from None
    missing = ["--" + n for n in _REQUIRED[command] if getattr(args, n) is None]
    if missing:
        raise ConfigError(
            [f"keel {command} needs {' and '.join(missing)}, or a config that names it"]
        )


def _settings_of(args, command: str) -> dict:
    """The flags `args.config` sets: keel's own run config names its output folder (what
    it trained: `keel chat run.yaml` after `keel train run.yaml`); theirs, what their
    command would use, with the mapping report on stderr."""
    from keel.cli_convert import mapping_report
    from keel.config.dialects import detect_dialect
    from keel.config.dialects.commands import translate_command
    from keel.config.dialects.report import refusal_problems
    from keel.config.load import read_their_config

    raw = read_their_config(Path(args.config), args.overrides)
    if detect_dialect(raw) is None and isinstance(raw.get("output"), dict):
        out = raw["output"].get("dir")
        if not isinstance(out, str) or not out:
            raise ConfigError([f"{args.config}: keel's run config names no output.dir"])
        print(f"{args.config}: keel's run config: --model {out} (its output.dir)", file=sys.stderr)
        if command == "predict":
            return _run_config_predict(args)
        merged = {"out": str(Path(out) / "merged")} if command == "export" else {}
        return {"model": out, **merged}
    translation = translate_command(raw, Path(args.config), command)
    print(mapping_report(args.config, translation), file=sys.stderr)
    if problems := refusal_problems(translation):
        raise ConfigError(problems, source=args.config)
    return translation.config


def _run_config_predict(args) -> dict:
    """keel predict on keel's run config: what it trained answers its data.eval_datasets
    (or --data), rendered and limited by its data settings, into output.dir/predict."""
    import dataclasses

    from keel.config import load_config

    cfg = load_config(args.config, args.overrides)
    out = Path(cfg.output.dir)
    held_out = cfg.data.eval_datasets
    if held_out:
        print(f"{args.config}: the rows: its data.eval_datasets", file=sys.stderr)
    run_data = dataclasses.replace(cfg.data, datasets=held_out, eval_datasets=[])
    return {"model": str(out), "out": str(out / "predict"), "run_data": run_data}


def _fill(args, settings: dict) -> None:
    """Set each flag the command line left unset; a flag it gives wins, and says so."""
    for name, value in settings.items():
        if getattr(args, name) in (None, []):
            setattr(args, name, value)
        else:
            flag = "--" + name.replace("_", "-")
            print(f"note: {flag} as the command line gives it", file=sys.stderr)
