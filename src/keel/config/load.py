"""YAML + `a.b=c` overrides -> a checked `RunConfig`, with every problem reported at once."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from keel.config.schema import DatasetConfig, RunConfig, TrainConfig
from keel.errors import ConfigError
from keel.stages.registry import STAGES, spoken, stage_sections

if TYPE_CHECKING:
    from keel.config.dialects import Translation


def load_config(
    path: str | Path | None,
    overrides: list[str] = (),
    *,
    base: dict | None = None,
    on_translation: Callable[[Translation], None] | None = None,
) -> RunConfig:
    """Read a YAML file (or start from `base`), apply `key.sub=value` overrides, check it all.

    A LLaMA-Factory or Axolotl file is translated to keel's config first (the overrides name
    keel's keys); `on_translation` receives that Translation (`keel train` prints its report).
    Raises ConfigError listing every problem, each with its key, value, location and fix.
    """
    source = str(path) if path is not None else "config"
    raw: dict = copy.deepcopy(base or {})  # overrides must not change the caller's dict
    problems: list[str] = []
    where = _Locator(source, {})
    if path is not None:
        raw, where.lines, problems = _read_yaml(Path(path))
        raw = _from_dialect(raw, Path(path), overrides, where, problems, on_translation)
    for item in overrides:
        problem = apply_override(raw, item)
        if problem:
            problems.append(problem)
            continue
        where.lines[item.split("=", 1)[0].strip()] = -1  # -1: came from the command line
    if isinstance(raw, dict) and "preference" in raw:
        problems.append(_preference_moved(raw, where))
    cfg = _build(RunConfig, raw, "", problems, where)
    if not problems:
        from keel.config.validate import check_config

        problems.extend(check_config(cfg))
    if not problems:
        from keel.config.start_adapter import with_start_adapter

        given = (raw.get("method") or {}) if isinstance(raw, dict) else {}
        cfg, adapter_problems = with_start_adapter(cfg, given)
        problems.extend(adapter_problems)
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def read_their_config(path: Path, overrides: list[str]) -> dict:
    """Their YAML (a LLaMA-Factory or Axolotl file) as a mapping, with `key=value` settings
    of the command line laid over it as their CLIs do (`infer_backend=vllm`); ConfigError
    for a missing or malformed file, a key set twice, or a malformed setting."""
    raw, _lines, problems = _read_yaml(path)
    problems += [p for p in (apply_override(raw, item) for item in overrides) if p]
    if problems:
        raise ConfigError(problems, source=str(path))
    return raw


def _read_yaml(path: Path) -> tuple[dict, dict[str, int], list[str]]:
    """(the mapping, the line of every key path, problems such as keys given twice)."""
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist; pass the path to a YAML file"])
    from keel.files import read_text

    text = read_text(path, what="config file", error=lambda msg: ConfigError([msg]))
    try:
        node = yaml.compose(text)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path} is not valid YAML: {exc}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            [
                f"{path} must hold a mapping of sections (model, data, ...), "
                f"found {type(raw).__name__}"
            ]
        )
    lines: dict[str, int] = {}
    duplicates: list[str] = []
    _collect_lines(node, "", lines, duplicates)
    return raw, lines, [f"{key} is set twice, {_twice(path, *at)}" for key, *at in duplicates]


def _twice(path: Path, first: int, second: int, value: str) -> str:
    return (
        f"at {path}:{first} and {path}:{second}; YAML would silently keep the second "
        f"({value}): delete one of them"
    )


_MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *defaults` may be overridden on purpose


def _collect_lines(node, prefix: str, out: dict[str, int], duplicates: list) -> None:
    """The line of every key path under `node`; (key, first line, second line, second
    value) to `duplicates` for each key a mapping holds twice, at any depth."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            ident = (key_node.tag, str(key_node.value))
            if ident in seen and key_node.tag != _MERGE_TAG:
                shown = value_node.value if isinstance(value_node, yaml.ScalarNode) else "..."
                duplicates.append((key, seen[ident], line, shown))
            seen.setdefault(ident, line)
            out[key] = line
            _collect_lines(value_node, key + ".", out, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            out[f"{prefix}{index}"] = item.start_mark.line + 1
            _collect_lines(item, f"{prefix}{index}.", out, duplicates)


def apply_override(raw: dict, item: str) -> str | None:
    """Set `a.b.c=value` (value parsed as YAML) in the nested dict; return a problem or None."""
    if "=" not in item:
        return f"override {item!r} is not of the form key.sub=value (e.g. train.lr=1e-4)"
    key, value_text = (part.strip() for part in item.split("=", 1))
    try:
        value = yaml.safe_load(value_text) if value_text else ""
    except yaml.YAMLError:
        value = value_text
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        nxt = _child(node, part)
        if isinstance(node, list) and isinstance(nxt, str):
            nxt = {"path": nxt}  # a dataset given by its path alone, now getting more keys
            _set_child(node, part, nxt)
        if nxt is None:
            nxt = {}
            if not _set_child(node, part, nxt):
                return f"override {item!r}: cannot index {'.'.join(parts[: depth + 1])}"
        elif not isinstance(nxt, dict | list):
            return f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a section"
        node = nxt
    if not _set_child(node, parts[-1], value):
        return f"override {item!r}: cannot set {key}"
    return None


def _child(node, part: str):
    if isinstance(node, list):
        return node[int(part)] if part.isdigit() and int(part) < len(node) else None
    return node.get(part)


def _set_child(node, part: str, value) -> bool:
    if isinstance(node, list):
        if not part.isdigit() or int(part) > len(node):
            return False
        if int(part) == len(node):
            node.append(value)
        else:
            node[int(part)] = value
        return True
    node[part] = value
    return True


def _from_dialect(raw: dict, path: Path, overrides, where: _Locator, problems, on_translation):
    """A LLaMA-Factory or Axolotl config as keel's (a keel config as it is): each refused key
    to `problems`, and `where` told which of their keys each keel key came from. The
    translation's checks of the model read the one keel's overrides name (model.path,
    model.revision), if any."""
    from keel.config.dialects import detect_dialect, translate, unread_dialect

    unread = unread_dialect(raw)
    if unread is not None:
        raise ConfigError([unread], source=str(path))
    if detect_dialect(raw) is None:
        return raw
    overridden: dict = {}
    for item in overrides:
        if item.split("=", 1)[0].strip() in ("model.path", "model.revision"):
            apply_override(overridden, item)
    translation = translate(raw, path, overridden.get("model"))
    if on_translation is not None:
        on_translation(translation)
    problems.extend(
        f"{where.at_theirs(fate.key)} is refused: {fate.why}" for fate in translation.refused()
    )
    where.came_from(translation.fates)
    return copy.deepcopy(translation.config)  # the overrides must not change the report's


def load_section(cls, raw: dict, prefix: str, source: str):
    """One section of the run config (e.g. DataConfig, for `keel predict`) built from `raw`
    and checked as load_config checks it; ConfigError listing every problem. `prefix`
    ("data.") names its keys in messages."""
    problems: list[str] = []
    built = _build(cls, raw, prefix, problems, _Locator(source, {}))
    if problems:
        raise ConfigError(problems, source=source)
    return built


class _Locator:
    """Turns a key path into 'key (file:line)' for messages; a key translated from another
    framework's config names theirs: 'train.lr (learning_rate, file:line)'."""

    def __init__(self, source: str, lines: dict[str, int]):
        self.source, self.lines = source, lines
        self.theirs: dict[str, str] = {}  # keel key -> the key of theirs it came from

    def came_from(self, fates) -> None:
        """Locate each keel key a translation wrote at the key of theirs it came from."""
        for fate in fates:
            line = self._line_of_theirs(fate.key)
            if fate.fate != "mapped" or line is None:
                continue
            for target in fate.target.replace(",", " ").split():
                self.lines.setdefault(target, line)
                self.theirs[target] = fate.key

    def at_theirs(self, key: str) -> str:
        """Their `key` with the line it is at (a key in the DeepSpeed JSON: the line that
        names the JSON), or with the file alone for a key their file leaves out."""
        line = self._line_of_theirs(key)
        return f"{key} ({self.source}:{line})" if line is not None else f"{key} ({self.source})"

    def _line_of_theirs(self, key: str) -> int | None:
        """The line of `key`, else of the nearest key above it (a key inside the JSON file
        their `deepspeed: ds.json` names is at that line)."""
        parts = key.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.lines:
                return self.lines[".".join(parts[:end])]
        return None

    def __call__(self, key: str) -> str:
        # a section set only through keys below it (an override a.b=c) is where they are
        below = (line for name, line in self.lines.items() if name.startswith(f"{key}."))
        line = self.lines.get(key, next(below, None))
        if line is None:
            return key
        if line < 0:
            return f"{key} (command line)"
        if key in self.theirs:
            return f"{key} ({self.theirs[key]}, {self.source}:{line})"
        return f"{key} ({self.source}:{line})"


def _build(cls, raw, prefix: str, problems: list[str], where: _Locator):
    """Build dataclass `cls` from `raw`, appending problems instead of raising."""
    if not isinstance(raw, dict):
        problems.append(f"{where(prefix.rstrip('.')) or 'config'} must be a mapping, got {raw!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            hint = _unknown_key_hint(prefix, str(key), list(fields))
            problems.append(f"unknown key {where(prefix + str(key))}{hint}")
    values = {}
    for name, f in fields.items():
        key = prefix + name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"missing required key '{key}'{_required_hint(key)}")
            continue
        values[name] = _coerce(hints[name], raw[name], key, problems, where)
    if any(v is _INVALID for v in values.values()) or _missing_required(cls, raw):
        return None
    return cls(**values)


def _unknown_key_hint(prefix: str, key: str, valid: list[str]) -> str:
    """The closest valid key; for a stage's section, else the other sections that hold
    `key` (`dpo.desirable_weight`: did you mean 'kto.desirable_weight'?); else every key."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    section, sections = prefix.rstrip("."), stage_sections()
    if section in sections:  # another stage's setting, most likely
        holders = [
            f"'{name}.{key}'"
            for name, settings in sections.items()
            if key in {f.name for f in dataclasses.fields(settings)}
        ]
        if holders:
            return f"; did you mean {spoken(holders)}? ({section} has {', '.join(valid)})"
    return f"; valid keys: {', '.join(valid)}"


def _preference_moved(raw: dict, where: _Locator) -> str:
    """The fix for a `preference:` section (keel before per-stage sections): the section
    of train.stage to write instead, with the settings that stage reads."""
    old = raw.pop("preference")
    old = old if isinstance(old, dict) else {}
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    name = str(train.get("stage", TrainConfig().stage))
    stage = STAGES.get(name)
    said = f"{where('preference')} was split into per-stage sections"
    if stage is None or stage.settings is None:
        sections = ", ".join(stage_sections())
        return f"{said} ({sections}) and train.stage {name} has none: remove preference"
    kept = {key: value for key, value in old.items() if key in stage.knobs}
    dropped = [str(key) for key in old if key not in stage.knobs]
    unread = f"; {name} has no {', '.join(dropped)}" if dropped else ""
    if not kept:
        return (
            f"{said}: remove it (train.stage {name} reads {name}: {', '.join(stage.knobs)}){unread}"
        )
    written = yaml.safe_dump(kept, default_flow_style=True, width=1000).strip()
    return f"{said}: for train.stage {name} write {name}: {written} instead{unread}"


_INVALID = object()


def _missing_required(cls, raw) -> bool:
    return any(
        f.name not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )


def _required_hint(key: str) -> str:
    hints = {
        "model": ": add a model section with path: <HF dir> or bundled:smollm2-135m-instruct",
        "model.path": " (an HF model directory, or bundled:smollm2-135m-instruct)",
        "data": ": add a data section with a datasets list",
        "data.datasets": " (a list of dataset files or dataset_info.json names)",
        "output": ": add an output section with dir: <where results go>",
        "output.dir": " (the folder for checkpoints, metrics and the trained model)",
    }
    if key.startswith(("data.datasets.", "data.eval_datasets.")) and key.endswith(".path"):
        return " (a data file, folder, or a name in dataset_info.json)"
    return hints.get(key, "")


def _coerce(tp, value, key: str, problems: list[str], where: _Locator):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        built = _build(tp, value, key + ".", problems, where)
        return _INVALID if built is None else built
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(tp, value, key, problems, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(
            f"{where(key)} = {value!r} is not one of {', '.join(map(str, choices))}{hint}"
        )
        return _INVALID
    if origin is list:
        return _coerce_list(typing.get_args(tp)[0], value, key, problems, where)
    if origin is dict:
        if isinstance(value, dict) and all(
            isinstance(v, str | int | float | bool) for v in value.values()
        ):
            return {str(k): str(v) for k, v in value.items()}
        problems.append(f"{where(key)} must be a mapping of names to strings, got {value!r}")
        return _INVALID
    return _coerce_scalar(tp, value, key, problems, where)


def _coerce_union(tp, value, key, problems, where):
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        problems.append(f"{where(key)} must not be empty")
        return _INVALID
    sections = [a for a in args if dataclasses.is_dataclass(a)]
    if len(sections) == 1 and len(args) == 2 and type(None) in args:  # an optional section
        return _coerce(sections[0], value, key, problems, where)  # its own problems, named
    if float in args and (number := _float(value)) is not None and not math.isfinite(number):
        return _coerce_scalar(float, value, key, problems, where)  # says: must be finite
    for arg in (a for a in args if a is not type(None)):
        trial: list[str] = []
        result = _coerce(arg, value, key, trial, where)
        if not trial:
            return result
    names = " or ".join(_type_name(a) for a in args if a is not type(None))
    problems.append(f"{where(key)} = {value!r} must be {names}")
    return _INVALID


def _coerce_list(item_tp, value, key, problems, where):
    if item_tp is DatasetConfig and isinstance(value, str | dict):
        value = [value]  # a single dataset needs no list
    if not isinstance(value, list):
        problems.append(f"{where(key)} must be a list, got {value!r}")
        return _INVALID
    out = []
    for index, item in enumerate(value):
        if item_tp is DatasetConfig and isinstance(item, str):
            item = {"path": item}  # shorthand: a dataset is just its path or name
        out.append(_coerce(item_tp, item, f"{key}.{index}", problems, where))
    return _INVALID if any(v is _INVALID for v in out) else out


def _coerce_scalar(tp, value, key, problems, where):
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = _float(value)
        if number is not None and math.isfinite(number):
            return number
        if number is not None:  # .inf, nan, 1e999: no setting means that, and lr=inf trains NaN
            problems.append(f"{where(key)} = {value!r} must be a finite number")
            return _INVALID
    elif tp is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    problems.append(f"{where(key)} = {value!r} must be {_type_name(tp)}")
    return _INVALID


def _float(value) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _type_name(tp) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is list:
        return "a list"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def config_to_dict(cfg: RunConfig) -> dict:
    """The resolved config as plain data (for writing next to the outputs): of the stage
    sections, only train.stage's, with its values in use (its defaults where unset)."""
    out = {}
    for name, value in dataclasses.asdict(cfg).items():
        if name not in stage_sections():
            out[name] = value
        if name == "train" and cfg.stage_settings is not None:
            out[cfg.train.stage] = dataclasses.asdict(cfg.stage_settings)
    return out
