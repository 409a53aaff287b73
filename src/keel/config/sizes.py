"""Memory sizes as a config or a flag writes them (`24GiB`, `80GB`, `24g`, bytes).

Lives in config/ because `distributed.device_memory` is checked with the rest of the
config; the planner (`keel.plan.devices`) and the CLI's size flags read sizes through it too.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str | int) -> int:
    """Bytes in a memory size: `24GiB`, `80GB` (decimal), `24g` (a single letter is
    binary), or a plain number of bytes. Raises ValueError saying what is accepted."""
    match = _MEMORY.match(str(text))
    size = 0
    if match and match.group(2).lower() in _UNITS:
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(
            f"{text!r} is not a memory size; write it like 24GiB, 80GB, 24g "
            f"or a number of bytes (more than 0)"
        )
    return size
