"""Which process made a lock or a temporary folder, and whether it is still running.

A lock file or a partial folder records its maker (pid, host, start time) as JSON, so a
refusal can name the run that holds a folder, and a leftover of a process that died can be
told apart from the work of one that is still running: on the same host, a pid that no
longer exists is dead. On another host nothing can be checked, so keel assumes it runs.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Owner:
    """A process that made a lock or a temporary folder."""

    pid: int
    host: str
    since: str  # local time it started, ISO 8601

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.since}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def is_dead(self) -> bool:
        """True only when this process surely ended: same host and its pid is gone."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # someone else's process: alive
            return False
        return False


def this_process() -> Owner:
    return Owner(
        pid=os.getpid(), host=socket.gethostname(), since=time.strftime("%Y-%m-%dT%H:%M:%S")
    )


def parse_owner(text: str) -> Owner | None:
    """The Owner a lock or marker file holds, or None when it holds none (empty, damaged)."""
    try:
        value = json.loads(text)
        return Owner(pid=int(value["pid"]), host=str(value["host"]), since=str(value["since"]))
    except (ValueError, TypeError, KeyError):
        return None
