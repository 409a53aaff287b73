"""Sample completions of an online-RL run, one JSON object per completion, in
<output.dir>/completions.jsonl: what the policy wrote, how each reward function scored it,
and the advantage it trained with. Written by rank 0 (its own prompts) every
`grpo.log_completions_every` steps."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

COMPLETIONS_FILE = "completions.jsonl"


@dataclass(frozen=True, kw_only=True)
class CompletionRecord:
    """One sampled completion as the log shows it."""

    step: int  # the optimizer step that trained on it (1-based, as metrics.jsonl)
    prompt: object  # a str, or a list of messages (as the reward functions received it)
    completion: str
    rewards: dict[str, float | None]  # each function's score (None: unscorable)
    reward: float | None  # the weighted sum the advantage was computed from
    advantage: float
    extra: dict[str, object] = field(default_factory=dict)  # the reward functions' log_extra

    def to_json(self) -> str:
        record = {
            "step": self.step,
            "prompt": self.prompt,
            "completion": self.completion,
            "rewards": {name: _finite(value) for name, value in self.rewards.items()},
            "reward": _finite(self.reward),
            "advantage": self.advantage,
        }
        if self.extra:  # its own object: a logged column never shadows the fields above
            record["extra"] = self.extra
        return json.dumps(record, ensure_ascii=False, allow_nan=False)


def _finite(value: float | None) -> float | None:
    """NaN (an unscorable completion) as null: bare NaN is not JSON."""
    return None if value is None or math.isnan(value) else value


class CompletionsLog:
    """Appends sample completions to completions.jsonl; on resume, first drops the records
    of steps after the resume step (as metrics.jsonl does), so the file reads as one
    uninterrupted run."""

    def __init__(self, output_dir: Path, *, resume_step: int, every: int):
        self.path = output_dir / COMPLETIONS_FILE
        self.every = every
        self._truncate_after(resume_step)

    @classmethod
    def open(cls, output_dir: Path, every: int, *, resume_step: int) -> CompletionsLog | None:
        """The run's log, or None when it writes no samples (`every` 0: never, or not rank 0)."""
        return cls(output_dir, resume_step=resume_step, every=every) if every > 0 else None

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) writes its samples."""
        return self.every > 0 and step % self.every == 0

    def write(self, records: list[CompletionRecord]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.writelines(record.to_json() + "\n" for record in records)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line]
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
