"""Which config keys a resumed run may change, and which make it another run.

Each checkpoint's meta.json holds the run's whole config (`config_to_dict`). Resuming
compares it with this run's config key by key: a key outside `RESUMABLE` that differs means
the checkpoint belongs to another run, and the refusal names every such key with both values
(`train.lr was 0.0002 in the checkpoint, this run has 0.0005`), instead of a fingerprint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

# May differ between a checkpoint and the run resuming it: where and how often results are
# written, the process layout and its limits, the watchdog, the run's length (extension:
# see keel.train.optim.continue_schedule), the batch split (the global batch itself is checked
# on its own, so a run resumes on any number of processes), and speed or memory settings that
# leave the numbers the same. A name stands for itself and everything under it.
RESUMABLE = (
    "output",
    "distributed",
    "watchdog",
    "train.max_steps",
    "train.epochs",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.global_batch_size",
    "train.eval_every",
    "train.resume",
    "train.preempt_signal",
    "train.threads",
    "train.gradient_checkpointing",
    "train.padding_free",
    "train.loss_chunk_size",
    "model.cache_dir",
    "model.attn_implementation",
    "model.trust_remote_code",
    "data.num_proc",
)
# Compared through the run identity (keel.train.resume.RunIdentity), which holds only the
# settings of the method and stage in use: a LoRA setting does not matter to a full run.
IDENTITY_SECTIONS = ("method", "preference")


def resumable(key: str) -> bool:
    """Whether config key `key` (dotted, e.g. "output.save_every") may change on resume."""
    return any(key == name or key.startswith(f"{name}.") for name in RESUMABLE)


def config_differences(saved: dict, current: dict) -> list[tuple[str, str]]:
    """(key, line) for each key whose value differs and may not change on resume.

    Keys that only one side has (a setting added or removed between keel versions) are not
    compared: there is no value to compare with.
    """
    current = json.loads(json.dumps(current))  # as the checkpoint stored it: tuples are lists
    out = []
    for key, old, new in _differences(saved, current, ""):
        if resumable(key) or key.split(".")[0] in IDENTITY_SECTIONS:
            continue
        out.append((key, f"{key} was {old!r} in the checkpoint, this run has {new!r}"))
    return out


def _differences(old, new, key: str) -> Iterator[tuple[str, object, object]]:
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(old.keys() & new.keys()):
            yield from _differences(old[name], new[name], f"{key}.{name}" if key else name)
    elif _same_length_lists_of_dicts(old, new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from _differences(a, b, f"{key}[{index}]")
    elif old != new:
        yield key, old, new


def _same_length_lists_of_dicts(old, new) -> bool:
    return (
        isinstance(old, list)
        and isinstance(new, list)
        and len(old) == len(new)
        and all(isinstance(item, dict) for item in old + new)
    )
