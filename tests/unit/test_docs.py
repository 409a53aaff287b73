"""The documentation is checked like code: README.md and docs/*.md.

Every command line in a ```bash or ```sh block is parsed: `keel ...` (also `.venv/bin/keel`,
`python -m keel`, `torchrun ... -m keel`) by keel's own parser, and a config it names is
loaded and validated with its overrides (no model is loaded); `make X` must be a Makefile
target; a `python` script must exist; any other program must be in ALLOWED. Relative links
must resolve, anchors included. The configuration reference must be what
tools/config_reference.py generates from the schema, and every key it or any other page
names must exist. Field note 2's plan table must be what its command computes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import sys
import types
import typing
from pathlib import Path

import pytest

from keel.cli import parse_args
from keel.config import load_config
from keel.config.schema import RunConfig
from keel.config.validate import is_hub_id

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Programs other than keel, make and python that the docs may show.
ALLOWED = {"curl", "torchrun", "srun", "sbatch", "pip", "hf", "vllm", "wandb", "iconv"}
FENCE = re.compile(r"^```(\w*)")
SECTIONS = {f.name for f in dataclasses.fields(RunConfig)}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """[(language, line number of the first line, lines)] of the ``` blocks in `text`."""
    blocks, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = FENCE.match(line)
        if current is None and opening:
            current = (opening.group(1), number + 1, [])
        elif current is not None and line.startswith("```"):
            blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, "a ``` block is not closed"
    return blocks


def command_lines() -> list[tuple[str, list[str]]]:
    """[("page:line", words)] of every command in the pages' bash/sh blocks."""
    found = []
    for page in PAGES:
        for lang, first, lines in fenced_blocks(page.read_text(encoding="utf-8")):
            if lang not in ("bash", "sh"):
                continue
            pending, start = "", first
            for number, line in enumerate(lines, first):
                if not pending:
                    start = number
                pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
                if line.endswith("\\"):
                    continue
                words = shlex.split(pending, comments=True)
                pending = ""
                if words:
                    found.append((f"{_rel(page)}:{start}", words))
    return found


COMMANDS = command_lines()


def _keel_args(words: list[str]) -> list[str] | None:
    """The keel arguments of a command line, or None when it does not run keel."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    program = Path(words[0]).name
    if program == "keel":
        return words[1:]
    if program in ("python", "torchrun", "srun") and "-m" in words:
        at = words.index("-m")
        if words[at + 1] == "keel":
            return words[at + 2 :]
    return None


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.MULTILINE))


def _check_config(args, where: str) -> None:
    path = Path(args.config)
    assert path.is_file(), f"{where}: {args.config} does not exist"
    cfg = load_config(path, args.overrides)  # raises ConfigError naming every problem
    if cfg.data.dataset_dir is None:
        for dataset in cfg.data.datasets:
            exists = Path(dataset.path).exists() or is_hub_id(dataset.path)
            assert exists, f"{where}: data path {dataset.path} does not exist"


@pytest.mark.parametrize("where,words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_command_in_the_docs_parses(where, words, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository
    keel = _keel_args(words)
    env_free = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    program = Path(env_free[0]).name
    if keel is not None:
        try:
            args = parse_args(keel)
        except SystemExit as exc:
            pytest.fail(f"{where}: keel's parser refuses {shlex.join(keel)} (exit {exc.code})")
        if getattr(args, "config", None):
            _check_config(args, where)
    elif program == "make":
        assert set(env_free[1:]) <= _makefile_targets(), f"{where}: no such make target"
    elif program == "python":
        script = env_free[1]
        assert (ROOT / script).is_file(), f"{where}: {script} does not exist"
    else:
        assert program in ALLOWED, f"{where}: {program} is neither keel nor in ALLOWED"


def test_the_docs_hold_the_commands_they_should():
    """The extraction itself works: a guard against a test that checks nothing."""
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/serving.md", "docs/distributed.md"} <= pages
    assert sum(_keel_args(words) is not None for _, words in COMMANDS) >= 30


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    outside = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+ (.+)$", outside, flags=re.MULTILINE):
        slug = _slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {_rel(path)}")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


def test_the_readme_is_a_front_page_and_the_index_lists_every_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
    index = set(links(DOCS / "README.md"))
    assert {p.name for p in DOCS.glob("*.md")} - {"README.md"} <= index
    assert "docs/README.md" in links(ROOT / "README.md")


def _generator():
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "tools/config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_generated_from_the_schema():
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert _generator().updated(text) == text, "run: python tools/config_reference.py"


def _unwrapped(tp):
    """The dataclass of an optional section (a stage's: `dpo: DpoSettings | None`), else tp."""
    parts = [part for part in typing.get_args(tp) if part is not type(None)]
    if typing.get_origin(tp) is types.UnionType and len(parts) == 1:
        return parts[0] if dataclasses.is_dataclass(parts[0]) else tp
    return tp


def schema_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    """Every key of the schema, recursively (list items as name[])."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, name = _unwrapped(hints[f.name]), f"{prefix}{f.name}"
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            tp, name = typing.get_args(tp)[0], f"{name}[]"
        if dataclasses.is_dataclass(tp):
            keys += schema_keys(tp, f"{name}.")
        elif prefix:
            keys.append(name)
    return keys


def test_every_schema_key_is_in_the_reference():
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    missing = [key for key in schema_keys() if f"`{key}`" not in text]
    assert not missing, f"not in docs/configuration.md: {missing}"


def _resolves(key: str) -> bool:
    node, hints = RunConfig, typing.get_type_hints(RunConfig)
    for part in key.replace("[]", "").split("."):
        if part.isdigit():  # data.datasets.0.path
            continue
        if node is None or part not in hints:
            return False
        tp = _unwrapped(hints[part])
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            tp = typing.get_args(tp)[0]
        node = tp if dataclasses.is_dataclass(tp) else None
        hints = typing.get_type_hints(node) if node else {}
    return True


FILE_SUFFIXES = {"json", "jsonl", "txt", "py", "yaml", "md", "png", "safetensors", "lock"}


def test_every_key_the_docs_name_exists():
    sections = "|".join(SECTIONS)
    pattern = re.compile(rf"`((?:{sections})\.[A-Za-z_][\w.\[\]]*)(?:[=:][^`]*)?`")
    unknown = []
    for page in PAGES:
        for key in pattern.findall(page.read_text(encoding="utf-8")):
            key = key.rstrip(".")
            if key.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not _resolves(key):
                unknown.append(f"{_rel(page)}: {key}")
    assert not unknown, unknown


def _plan_rows(text: str) -> list[list[str]]:
    """The rows of the first table after "Field note 2", each a list of its cells."""
    after = text.split("Field note 2", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("| strategy"))
    rows = []
    for line in after[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip(" *") for cell in line.strip("|").split("|")])
    return rows


def test_field_note_2_plan_table_is_what_its_command_computes(tmp_path, monkeypatch):
    import json

    from test_plan import QWEN2_72B

    from keel.plan import detect_devices, plan_run

    monkeypatch.chdir(ROOT)
    text = (DOCS / "distributed.md").read_text(encoding="utf-8")
    (words,) = [w for where, w in COMMANDS if "model.path=Qwen/Qwen2-72B" in w]
    args = parse_args(_keel_args(words))
    model = tmp_path / "qwen2-72b"  # its config.json, as `keel plan` fetches it from the Hub
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN2_72B))
    overrides = [o for o in args.overrides if not o.startswith("model.path=")]
    cfg = load_config(args.config, [*overrides, f"model.path={model}"])
    devices = detect_devices(gpus=args.gpus, memory=args.gpu_memory)
    plan = plan_run(cfg, devices=devices, log=lambda _: None)
    modes = {"off": False, "on": True, "offload": "offload"}
    rows = _plan_rows(text)
    assert len(rows) == 7
    for strategy, method, ckpt, total, host, _fits in rows:
        mode_list, hosts = ckpt.split(" / "), host.split(" / ")
        hosts = hosts * len(mode_list) if len(hosts) == 1 else hosts
        for mode, gib, host_gib in zip(mode_list, total.split(" / "), hosts, strict=True):
            option = plan.option_for(strategy, method, modes[mode])
            for said, bytes_ in ((gib, option.per_device.total), (host_gib, option.host_bytes)):
                decimals = len(said.partition(".")[2])
                close = abs(bytes_ / 2**30 - float(said)) <= 0.5 * 10**-decimals + 1e-9
                assert close, f"{strategy} {method} {mode}: docs {said}, plan {bytes_ / 2**30:.2f}"
