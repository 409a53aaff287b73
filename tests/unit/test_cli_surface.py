"""Freeze the CLI surface: a flag or subcommand must never disappear by accident."""

import argparse

from keel.cli import build_parser

EXPECTED = {
    "train": {
        "config",
        "overrides",
        "--nproc",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--max-restarts",
        "--force",
    },
    "validate": {"config", "overrides", "--nproc", "--nnodes"},
    "convert": {"config", "--out"},
    "chat": {
        "config",  # their chat config (LLaMA-Factory), or their training config (Axolotl)
        "overrides",
        "--model",
        "--adapter",
        "--prompt",
        "--image",
        "--system",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--cache-dir",
    },
    "plan": {"config", "overrides", "--gpus", "--nodes", "--gpu-memory", "--json"},
    "doctor": {"--json"},
    "export": {
        "config",
        "overrides",
        "--model",
        "--adapter",
        "--out",
        "--dtype",
        "--max-shard-size",
        "--cache-dir",
        "--quantize",  # torchao-quantized decoder weights (method.qat's scheme, or one named)
    },
    "expand": {"--model", "--blocks", "--out", "--max-shard-size", "--cache-dir"},
    "predict": {
        "config",  # LLaMA-Factory's predict config, keel's run config, Axolotl's training config
        "overrides",
        "--model",
        "--adapter",
        "--data",
        "--dataset-dir",
        "--out",
        "--template",
        "--cutoff-len",
        "--max-samples",
        "--skip-long",
        "--skip-invalid",
        "--system",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--max-batch-size",
        "--cache-dir",
        "--nproc",  # data-parallel answering via torchrun
    },
    "serve": {
        "config",
        "overrides",
        "--model",
        "--adapter",
        "--host",
        "--port",
        "--api-key",
        "--max-batch-size",
        "--max-concurrency",
        "--max-tokens",
        "--backend",
        "--cache-dir",
        "--adapter-root",
        "--max-prompts",
        "--max-prompt-tokens",
        "--max-prefill-tokens",
        "--max-adapters",
        "--max-lora-rank",
        "--max-adapter-size",
        "--max-images",
        "--max-image-pixels",
        "--max-image-size",
        "--image-root",
    },
}


def surface(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, child in sub.choices.items():
        names = set()
        for action in child._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names.update(action.option_strings or [action.dest])
        found[name] = names
    return found


def test_cli_surface_is_frozen():
    parser = build_parser()
    assert surface(parser) == EXPECTED
    assert {"--debug", "--verbose"} <= {s for a in parser._actions for s in a.option_strings}


def test_user_errors_exit_2_without_traceback(tmp_path, capsys):
    from keel.cli import main

    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
