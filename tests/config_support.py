"""Configs for tests: the least one that validates, and a tiny LoRA run for the tests that
train for real (a rank-4 adapter on the tiny model, two rows a step, fp32 on one thread, a
checkpoint every 2 steps)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def minimal_config(folder: Path, **output) -> dict:
    """A config that validates (the model folder is never loaded, the data file is empty)
    and writes into folder/out; `output` entries are added to its output section."""
    (folder / "d.json").write_text("[]")
    return {
        "model": {"path": str(folder)},
        "data": {"datasets": [str(folder / "d.json")]},
        "output": {"dir": str(folder / "out"), **output},
    }


def run_config_with(folder: Path, settings: dict):
    """A RunConfig (the schema's dataclasses, unvalidated) of a model at `folder`, with each
    dotted key of `settings` set to its value ("distributed.context_parallel": 2)."""
    from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig

    cfg = RunConfig(
        model=ModelConfig(path=str(folder)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(folder / "out")),
    )
    for dotted, value in settings.items():
        section, name = dotted.rsplit(".", 1)
        node = cfg
        for part in section.split("."):
            node = getattr(node, part)
        setattr(node, name, value)
    return cfg


def model_type_folder(root: Path, model_type: str) -> Path:
    """root/<model_type>: a model folder as far as config-level code (a dialect's
    translation) reads one, a config.json with its model_type alone."""
    folder = root / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def hide_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make `importlib.util.find_spec` report the modules `names` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a)
    )


def qa_rows(n: int) -> list[dict[str, str]]:
    """`n` short alpaca rows, each different."""
    return [
        {"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(n)
    ]


def tiny_lora_config(
    model_dir: Path,
    data: Path,
    out: Path,
    *,
    cutoff_len: int = 64,
    train: dict | None = None,
    output: dict | None = None,
) -> dict:
    """The run's config as a dict (for `load_config(base=...)` or a YAML file); `train` and
    `output` add to (or replace) those sections' entries."""
    return {
        "model": {"path": str(model_dir), "cache_dir": str(out.parent / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data)], "cutoff_len": cutoff_len},
        "train": {
            "max_steps": 2,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "precision": "fp32",
            "threads": 1,
            **(train or {}),
        },
        "output": {"dir": str(out), "save_every": 2, **(output or {})},
    }
