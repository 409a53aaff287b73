"""Resolve the reward specs of a config (`grpo.rewards`) into callables.

Three spellings: "file.py:function" (a Python file, relative to the config's folder),
"package.module:function" (anything importable, e.g. keel.rewards:format), or the folder of
a `*ForSequenceClassification` model (a reward model, e.g. the output of `train.stage: rm`).
Every bad spec is reported at once, each with its fix.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from keel.errors import ConfigError, KeelError

_KEY = "grpo.rewards"
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


@dataclass(frozen=True)
class RewardFunction:
    """A reward, named as the config spells it."""

    name: str  # "my_rewards.py:correct", "keel.rewards:format", or a folder path
    call: Callable[..., list]  # (prompts=, completions=, completion_ids=, **columns) -> floats
    # what metrics call it (`rewards/<short>/mean`, TRL's names): the function's name, or
    # the reward model folder's; the whole spec where two rewards would share one
    short: str = ""

    def __post_init__(self):
        if not self.short:
            object.__setattr__(self, "short", _short(self.name))


def load_rewards(specs: list[str], base_dir: Path, *, device: str = "cpu") -> list[RewardFunction]:
    """The reward functions `specs` name, in order; a ConfigError listing every spec that
    does not resolve. Relative paths are relative to `base_dir` (the working directory, as
    data paths are); a reward model is loaded onto `device` once, here."""
    functions, problems = [], []
    shorts = short_names(specs)
    for index, spec in enumerate(specs):
        try:
            call = _resolve(spec, base_dir, device)
            functions.append(RewardFunction(name=spec, call=call, short=shorts[index]))
        except _SpecProblem as problem:
            problems.append(f"{_KEY}.{index} = {spec!r}: {problem}")
    if problems:
        raise ConfigError(problems)
    return functions


def short_names(specs: list[str]) -> list[str]:
    """Each spec's name in metrics: "sums.py:correct" -> "correct", a folder -> its name
    (TRL names a reward after its function); the whole spec where two would be equal."""
    shorts = [_short(spec) for spec in specs]
    return [spec if shorts.count(s) > 1 else s for spec, s in zip(specs, shorts)]


def _short(spec: str) -> str:
    folder = ":" not in spec or (_WINDOWS_DRIVE.match(spec) and ":" not in spec[2:])
    if folder:
        return Path(spec.rstrip("/\\")).name or spec
    return spec.rsplit(":", 1)[1]


class _SpecProblem(Exception):
    """What is wrong with one spec, and the fix (collected into one ConfigError)."""


def _resolve(spec: str, base_dir: Path, device: str) -> Callable[..., list]:
    text = spec.strip()
    source, colon, attribute = text.rpartition(":")
    if _WINDOWS_DRIVE.match(text) and ":" not in text[2:]:
        colon = ""  # a Windows folder (C:\models\rm), not a function of module "C"
    if colon and source.endswith(".py"):
        return _attribute(_load_file(_path(source, base_dir)), attribute)
    if colon and _MODULE_NAME.fullmatch(source):
        return _attribute(_import(source), attribute)
    if text.endswith(".py"):
        raise _SpecProblem(f"name the function in the file: {text}:<function>")
    folder = _path(text, base_dir)
    if not folder.is_dir():
        raise _SpecProblem(
            f"{folder} is not a folder, and the spec is not file.py:function or "
            "package.module:function; write one of those (e.g. keel.rewards:format), or the "
            "path of a reward model's folder"
        )
    from keel.rewards.reward_model import load_reward_model  # transformers: only when used

    try:
        return load_reward_model(folder, device=device)
    except KeelError as error:
        raise _SpecProblem(str(error)) from error


def _path(text: str, base_dir: Path) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else Path(base_dir) / path


def _load_file(path: Path) -> ModuleType:
    """Import a reward file once per process (its path names the module)."""
    if not path.is_file():
        raise _SpecProblem(
            f"no file {path} (a file.py path is relative to the config's folder); fix the "
            "path, or use package.module:function for an installed module"
        )
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"keel_reward_file_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise _SpecProblem(
            f"importing {path} raised {type(error).__name__}: {error}; fix the file "
            "(run `python <file>` to see the traceback)"
        ) from error
    return module


def _import(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise _SpecProblem(
            f"no module named {error.name!r}; install it, or point at a file instead: "
            "path/to/file.py:function"
        ) from error
    except Exception as error:
        raise _SpecProblem(
            f"importing {module_name} raised {type(error).__name__}: {error}"
        ) from error


def _attribute(module: ModuleType, attribute: str) -> Callable[..., list]:
    function = getattr(module, attribute, None) if attribute else None
    if callable(function):
        return function
    where = getattr(module, "__file__", None) or module.__name__
    if function is not None:
        raise _SpecProblem(f"{attribute} in {where} is a {type(function).__name__}, not callable")
    candidates = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and inspect.isfunction(value)
    ]
    close = difflib.get_close_matches(attribute, candidates, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise _SpecProblem(
        f"{where} has no function {attribute!r}; {hint}its functions: "
        f"{', '.join(sorted(candidates)) or 'none'}"
    )
