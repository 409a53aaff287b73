"""The hang report: from every rank's last heartbeat, who is behind, who stopped answering,
and where the ranks' sequences of keel's collectives first differ."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil


def build_hang_report(
    reason: str, beats: dict[int, dict | None], *, live: set[int], diagnostics: Path
) -> str:
    """The console/file report of a hang from every rank's last heartbeat."""
    lines = [f"keel watchdog: the run is stuck: {reason}"]
    silent = sorted(r for r in beats if r not in live)
    alive = {r: b for r, b in beats.items() if b and r in live}
    behind = _behind(alive)
    if silent:
        lines.append(
            f"not responding (no heartbeat; stopped, killed or frozen): rank(s) "
            f"{', '.join(map(str, silent))}"
        )
    if behind:
        lines.append(f"behind the others: rank(s) {', '.join(map(str, behind))}")
    lines.append("each rank's last known position:")
    for r in sorted(beats):
        beat = beats[r]
        if beat is None:
            lines.append(f"  rank {r}: never reported a heartbeat")
            continue
        last = beat["collectives"][-1] if beat["collectives"] else None
        last_text = f"#{last[0]} {last[1]}({last[2]}) at step {last[3]}" if last else "none"
        state = "alive" if r in live else "NOT RESPONDING, its last heartbeat"
        phase = f", phase '{beat['phase']}'" if beat.get("phase") else ""
        lines.append(
            f"  rank {r} ({state}, {beat['host']} pid {beat['pid']}): at "
            f"{beat['where']} (mark {beat['point']}{phase}), idle {beat['idle_s']} s; last "
            f"collective {last_text}"
        )
    lines.append(collective_divergence(alive))
    stacks = [f"rank-{r:05d}-stacks.txt" for r in sorted(live)]
    lines.append(f"stacks of every thread of the live ranks: {diagnostics}/ ({', '.join(stacks)})")
    return "\n".join(lines)


def end_frozen_siblings(beats: dict[int, dict | None], live: set[int]) -> None:
    """SIGKILL the ranks that stopped answering and run on this host under our launcher.

    torchrun would send them SIGTERM and wait 30 s before SIGKILL (a stopped process does
    not act on SIGTERM); the report is written, so nothing is lost by ending them now. The
    pid must still be a child of the same launcher, so a reused pid is never hit.
    """
    import signal

    host, parent = socket.gethostname(), os.getppid()
    for r, beat in beats.items():
        if r in live or not beat or beat.get("host") != host or beat.get("ppid") != parent:
            continue
        try:
            if psutil.Process(beat["pid"]).ppid() == parent:
                os.kill(beat["pid"], signal.SIGKILL)
        except (psutil.Error, OSError):
            pass


def _behind(beats: dict[int, dict]) -> list[int]:
    if len(beats) < 2:
        return []
    position = {r: (b["step"], b["point"]) for r, b in beats.items()}
    lowest = min(position.values())
    if all(p == lowest for p in position.values()):
        return []
    return sorted(r for r, p in position.items() if p == lowest)


def collective_divergence(beats: dict[int, dict]) -> str:
    """Where the ranks' collective sequences first differ, from their recent records."""
    if len(beats) < 2:
        return "collective sequences: fewer than two live ranks to compare"
    seqs = {r: {c[0]: tuple(c[1:]) for c in b["collectives"]} for r, b in beats.items()}
    lasts = {r: max(s) if s else -1 for r, s in seqs.items()}
    start = max(min(s) if s else 0 for s in seqs.values())
    for seq in range(start, max(lasts.values()) + 1):
        entries = {r: s.get(seq) for r, s in seqs.items()}
        if len({e for e in entries.values()}) > 1:
            steps = [e[2] for e in entries.values() if e]
            shown = "; ".join(
                f"rank {r}: " + _entry_text(e, beats[r], min(steps))
                for r, e in sorted(entries.items())
            )
            return f"collective sequences first differ at #{seq}: {shown}"
    return (
        f"collective sequences agree (up to #{min(lasts.values())}); the ranks are inside "
        f"a collective (e.g. a gradient all-reduce or an FSDP all-gather) or compute"
    )


def _entry_text(entry: tuple | None, beat: dict, step: int) -> str:
    if entry is not None:
        return f"{entry[0]}({entry[1]}) at step {entry[2]}"
    if beat["step"] > step:
        return f"never made it, and went on to step {beat['step']}"
    return f"not reached (still at {beat['where']})"
