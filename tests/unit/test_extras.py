"""A missing optional extra is a user error (exit 2) naming the pip command, before any load."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from config_support import hide_modules, minimal_config

from keel.config import load_config
from keel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("overrides", "module", "extra"),
    [
        (["output.loggers=[jsonl, tensorboard]"], "tensorboard", "tensorboard"),
        (["output.loggers=[jsonl, wandb]"], "wandb", "wandb"),
        (["method.type=qlora"], "torchao", "qlora"),
        (["train.optimizer=adamw_8bit"], "torchao", "qlora"),
        (["method.type=qlora", "method.qlora.quant_backend=bnb"], "bitsandbytes", "bnb"),
    ],
)
def test_config_needing_a_missing_extra_names_the_pip_command(
    tmp_path, monkeypatch, overrides, module, extra
):
    hide_modules(monkeypatch, module)
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, base=minimal_config(tmp_path))
    (problem,) = [p for p in info.value.problems if "not installed" in p]
    assert f"needs {module}, which is not installed" in problem
    assert problem.endswith(f"pip install 'keel[{extra}]'")


def test_installed_extras_are_not_a_problem(tmp_path):
    base = minimal_config(tmp_path, loggers=["jsonl", "tensorboard"])
    assert load_config(None, [], base=base).output.loggers == ["jsonl", "tensorboard"]


@pytest.mark.parametrize("module", ["fastapi", "uvicorn", "sse_starlette"])
def test_serve_without_the_serve_extra_exits_2_before_loading_the_model(tmp_path, module):
    # As if the module were not installed: importing it raises ModuleNotFoundError.
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from keel.cli import main\n"
        f"raise SystemExit(main(['serve', '--model', {str(tmp_path / 'no-model')!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"keel serve needs {module}" in result.stderr
    assert "pip install 'keel[serve]'" in result.stderr
    assert "no-model" not in result.stderr  # refused before the model was looked at
