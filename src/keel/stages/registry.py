"""The stages keel trains, by name: the one list every package reads.

Adding a stage: a module with its `STAGE` record (and its loss, and the dataclass of its
config section if it has settings of its own), and one line here.
"""

from __future__ import annotations

from keel.stages import dpo, grpo, kto, orpo, pt, rm, sft, simpo
from keel.stages.base import DataUnit, Stage, causal_lm_objective

STAGES: dict[str, Stage] = {
    s.name: s for s in (m.STAGE for m in (pt, sft, dpo, orpo, simpo, kto, rm, grpo))
}
# The names the config schema accepts (TrainConfig.stage), in the registry's order.
STAGE_NAMES: tuple[str, ...] = tuple(STAGES)


def get_stage(name: str) -> Stage:
    """The record of stage `name`; KeyError naming the valid stages if there is none."""
    stage = STAGES.get(name)
    if stage is None:
        raise KeyError(f"unknown stage '{name}'; the stages are {', '.join(STAGES)}")
    return stage


def stage_sections() -> dict[str, type]:
    """{stage name: the dataclass of its config section} of every stage with settings: the
    run config has one optional section per entry, named after the stage (`dpo: {beta: 0.1}`)."""
    return {s.name: s.settings for s in STAGES.values() if s.settings is not None}


def stages_of(unit: DataUnit) -> list[str]:
    """The names of the stages that train on `unit` rows."""
    return [s.name for s in STAGES.values() if s.unit == unit]


def next_token_stages() -> list[str]:
    """The names of the stages trained on the next-token cross-entropy (pt, sft): what
    token weighting, a router balance term and context parallelism apply to."""
    return [s.name for s in STAGES.values() if s.objective is causal_lm_objective]


def spoken(names: list[str]) -> str:
    """ "dpo, orpo or simpo": names as a sentence lists alternatives."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
