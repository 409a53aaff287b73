"""What a stage is (`Stage`), what its objective returns (`ObjectiveOutput`), and the
contract every objective keeps (`Objective`).

Declarative and torch-free at import: `keel.config` reads the registry to validate a run, so
nothing here may import the model or training code. A stage's objective is built through an
`ObjectiveKit` that set-up (keel.train.model_setup) hands the factory: the kit holds the
model and the objectives the stage families share, so a stage module never imports train/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from torch import Tensor, nn

    from keel.losses import PairLosses

# What one unit of a stage's data is: plain text (pt), a conversation whose assistant turns
# are trained (sft), a prompt with a chosen and a rejected answer, a prompt with one
# answer labelled desirable or not (kto), or a prompt alone, answered online (grpo).
DataUnit = Literal["text", "conversation", "pair", "sample", "prompt"]
# Where a run's reference log-probs come from (see `reference_source`).
ReferenceSource = Literal["precompute", "adapters", "copy"]


@dataclass
class Scored:
    """Per-sequence log-probs of a batch: sums over completion tokens and token counts."""

    sums: Tensor  # [S]
    counts: Tensor  # [S]

    @property
    def means(self) -> Tensor:
        return self.sums / self.counts.clamp_min(1)


@dataclass
class ObjectiveOutput:
    """What every objective's forward returns for a micro-batch.

    `loss` is a *sum* over the micro-batch's units and `count` their number (target tokens
    for pt/sft, pairs or samples for the preference stages): the trainer divides by the
    count of the whole global batch, so N processes compute the update one process computes.
    `statistics` is a fixed-layout [2 x len(metric_names)] vector of (sum, count) pairs, the
    same on every rank whatever the data, or None for objectives without metrics.
    """

    loss: Tensor  # []
    count: Tensor  # []
    statistics: Tensor | None = None


class Objective(Protocol):
    """The contract between a stage's objective and the one training loop (keel.train.loop).

    forward(batch) -> ObjectiveOutput. Objectives with `needs_window_statistic` also answer
    forward(batch, mode="statistic") -> (sum, count) over a micro-batch; the trainer reduces
    those over the global batch and calls `set_window_statistic` before the losses (KTO's
    reference point). forward(batch, mode="reference") -> (main, kl or None) log-probs is
    what `<stage>.reference: precompute` (e.g. dpo.reference) caches, for stages that use a
    reference. An objective whose rows are preference pairs may set `shares_pair_prompts`
    (keel.data.collate lays each pair's prompt out once); without it, sequences stay whole.
    """

    metric_names: tuple[str, ...]  # of the statistics vector, in order; () for none
    needs_window_statistic: bool

    def __call__(self, batch: dict) -> ObjectiveOutput: ...

    def set_window_statistic(self, value: float) -> None: ...


class ObjectiveKit(Protocol):
    """What set-up hands a stage's objective factory: the model (HF or PEFT), the run's
    settings, and builders of the objectives keel's stage families share."""

    model: nn.Module
    chunk_size: int  # tokens per chunk of the output layer + loss
    settings: StageSettings | None  # the run's section of this stage (cfg.stage_settings)

    def causal_lm(self) -> Objective:
        """Next-token cross-entropy summed over target tokens (pt, sft)."""

    def sequence_scores(self, stage: Stage) -> Objective:
        """Each sequence's completion log-prob, handed to `stage.pair_loss` (pairs) or to
        KTO's loss (labelled samples), with reference log-probs if the stage uses them."""

    def reward_scores(self, stage: Stage) -> Objective:
        """A scalar score per sequence (a trainable head on the backbone's hidden state at
        its last token), chosen against rejected with the Bradley-Terry loss (rm)."""

    def policy_gradient(self, stage: Stage) -> Objective:
        """The clipped policy-gradient loss of rollout rows (grpo): per-token log-probs at
        the sampling temperature against the rows' advantages (and old log-probs)."""


# Where a stage that uses a reference takes its log-probs from (its `reference` setting):
# live (LoRA: the base with adapters off; full/freeze: a frozen copy sharded like the
# policy) or precompute (one pass before training, cached); auto: live.
ReferenceSetting = Literal["auto", "live", "precompute"]


class StageSettings(Protocol):
    """A stage's config section, named after the stage (`dpo: {beta: 0.1}`): a keyword-only
    dataclass whose fields are the settings the stage reads, with defaults, declared in the
    stage's module. The loader (keel.config) builds it from YAML by its field types, so a key
    of another stage's section is an unknown key there."""

    def problems(self, section: str) -> list[str]:
        """What the field types cannot say (bounds, settings that exclude each other), each
        naming its key as `section.name`, its value and the fix."""


def positive(value: float, key: str) -> list[str]:
    """`key = value must be > 0`, or nothing: the bound most stage settings share."""
    return [] if value > 0 else [f"{key} = {value!r} must be > 0"]


# (policy scores, reference log-prob sums or None, the stage's settings) ->
# (losses, the chosen and rejected log-probs its logps/* metrics report)
PairLoss = Callable[["Scored", "Tensor | None", Any], "tuple[PairLosses, Tensor, Tensor]"]


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One training stage: what the data, the planner, the objective and the metrics need.

    `settings` is the dataclass of the stage's config section, the YAML key named after the
    stage (None: the stage reads no settings of its own). `formats` are the data formats
    (keel.data.formats) the stage trains on besides `auto`.
    """

    name: str
    summary: str  # one line: what the stage trains
    unit: DataUnit
    sequences_per_row: int  # of one unit before packing: 2 for a pair, else 1
    uses_reference: bool  # its loss compares with a frozen reference model's log-probs
    metric_names: tuple[str, ...]  # TRL's names, in the order of the statistics vector
    formats: tuple[str, ...]
    objective: Callable[[ObjectiveKit, Stage], Objective]  # called with the kit and this record
    pair_loss: PairLoss | None = None  # the loss of a pair stage's chosen/rejected scores
    # Whether a run with these settings needs its reference (grpo: only for a KL term);
    # None: whenever the stage uses one
    reference_needed: Callable[[Any], bool] | None = None
    settings: type[StageSettings] | None = None
    # What the objective puts on the backbone: the LM head (logits over the vocabulary) or
    # a score head of one output per sequence (rm), whose logits the planner need not count
    head: Literal["lm", "score"] = "lm"

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of the settings the stage reads: the fields of its section."""
        return tuple(f.name for f in fields(self.settings)) if self.settings else ()

    @property
    def counted(self) -> str:
        """What a step's count counts, as the metrics name it."""
        return {"pair": "pairs", "sample": "samples"}.get(self.unit, "target_tokens")


def reference_source(stage: Stage, settings: Any, by_adapters_off: bool) -> ReferenceSource | None:
    """Where a run's reference log-probs come from; None when the stage uses none, or
    these settings need none (`Stage.reference_needed`: grpo without a KL term).

    `settings` is the stage's section; a stage that uses a reference has a `reference`
    setting (auto | live | precompute). precompute: one pass with the policy before
    training, cached. Otherwise live, each step: with an adapter on an unchanged base
    (`by_adapters_off`: LoRA, OFT; not PiSSA) the policy with it switched off ("adapters"),
    else a frozen copy of the base ("copy").
    """
    if not stage.uses_reference:
        return None
    if stage.reference_needed is not None and not stage.reference_needed(settings):
        return None
    if settings.reference == "precompute":
        return "precompute"
    return "adapters" if by_adapters_off else "copy"


def causal_lm_objective(kit: ObjectiveKit, _stage: Stage) -> Objective:
    """The objective factory of the next-token stages (pt, sft)."""
    return kit.causal_lm()


def sequence_objective(kit: ObjectiveKit, stage: Stage) -> Objective:
    """The objective factory of the preference stages: sequence scores, then the stage's loss."""
    return kit.sequence_scores(stage)


def policy_gradient_objective(kit: ObjectiveKit, stage: Stage) -> Objective:
    """The objective factory of the online RL stages (grpo): the clipped policy gradient."""
    return kit.policy_gradient(stage)
