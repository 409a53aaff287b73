"""What a translation did with each of their keys, and the mapping report that says so."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Fate = Literal["mapped", "ignored", "refused"]
Dialect = Literal["llamafactory", "axolotl"]

DIALECT_NAMES = {"llamafactory": "LLaMA-Factory", "axolotl": "Axolotl"}


@dataclass(frozen=True)
class KeyFate:
    """One of their keys and what keel made of it."""

    key: str  # their key as written ("lora_rank", "datasets.0.type")
    fate: Fate
    target: str = ""  # the keel key(s) it became ("method.lora.r"), for mapped
    why: str = ""  # required for ignored and refused; an optional note for mapped

    def __post_init__(self):
        assert self.fate in ("mapped", "ignored", "refused"), self.fate
        assert self.fate == "mapped" or self.why, f"{self.key}: {self.fate} needs a why"


@dataclass
class Translation:
    """Their config as a keel config (nested dicts, as YAML holds them), with the fate of
    every one of their keys. `notes` name the keel settings written for keys they left
    out, where their default differs from keel's (so the run means the same)."""

    dialect: Dialect
    config: dict
    fates: list[KeyFate]
    notes: list[str] = field(default_factory=list)

    def refused(self) -> list[KeyFate]:
        """The keys keel cannot honour; any one of them stops the run."""
        return [fate for fate in self.fates if fate.fate == "refused"]

    def report(self) -> str:
        """The mapping report: one line per key, grouped by fate."""
        return render_report(self)


def render_report(translation: Translation) -> str:
    """Their keys grouped mapped / ignored / refused, one line each, then their defaults
    that keel writes out explicitly."""
    name = DIALECT_NAMES[translation.dialect]
    lines = [f"{name} config translated to keel ({_counts(translation.fates)}):"]
    for fate in ("mapped", "ignored", "refused"):
        group = [f for f in translation.fates if f.fate == fate]
        if group:
            lines.append(f"  {fate} ({len(group)}):")
            lines.extend(f"    {_line(f)}" for f in group)
    if translation.notes:
        lines.append(f"  {name} defaults kept ({len(translation.notes)}):")
        lines.extend(f"    {note}" for note in translation.notes)
    return "\n".join(lines)


def refusal_problems(translation: Translation) -> list[str]:
    """One ConfigError problem per refused key: the key, that keel refuses it, and why."""
    name = DIALECT_NAMES[translation.dialect]
    return [f"{f.key} ({name}) is refused: {f.why}" for f in translation.refused()]


def unknown_key(key: str, known: Iterable[str], why: str) -> str:
    """`why` a key is refused, with the closest known key when `key` looks like a typo of
    one (`lora_rnak`: did you mean `lora_rank`?)."""
    close = difflib.get_close_matches(key, [str(k) for k in known], n=1, cutoff=0.75)
    return f"{why}; did you mean `{close[0]}`?" if close else why


def _line(fate: KeyFate) -> str:
    if fate.fate == "mapped":
        note = f"  ({fate.why})" if fate.why else ""
        return f"{fate.key} -> {fate.target}{note}"
    return f"{fate.key}: {fate.why}"


def _counts(fates: list[KeyFate]) -> str:
    counts = {name: sum(f.fate == name for f in fates) for name in ("mapped", "ignored", "refused")}
    return ", ".join(f"{count} {name}" for name, count in counts.items())
