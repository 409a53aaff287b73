"""Preference stages (DPO, ORPO, SimPO, KTO) as objectives of the one training loop.

A preference batch holds whole sequences laid in rows (keel.data: a pair is its chosen then
its rejected sequence; a KTO sample is one sequence plus a mismatched one for the KL
estimate). The objective scores each sequence's completion tokens, sums them per sequence,
and hands the per-sequence log-probs to the pure losses in `keel.losses.preference`.

Like `CausalLMObjective`, forward returns a *sum* (of per-pair or per-sample losses) and its
count (pairs or samples): the trainer divides by the pairs of the whole global batch, so N
processes compute the update one process computes. Statistics come back as one fixed-layout
vector of (sum, count) pairs, the same names in the same order on every rank whatever the
data, which the trainer reduces with one all-reduce of scalars.

Definitions (as TRL's trainers, so dashboards compare): `logps/*` is the mean over pairs of
each completion's log-prob, summed over its tokens for DPO and KTO and averaged per token
for ORPO and SimPO (and for DPO's ipo loss inside the loss); rewards are beta x (policy -
reference) for DPO/KTO and beta x the mean log-prob for ORPO/SimPO.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from keel.distributed.context_parallel import CP_GROUP, group_sum
from keel.losses import preference as losses
from keel.losses.causal_lm import IGNORE_INDEX, chunked_token_logps, token_logps
from keel.models.vision.family import VisionFamily
from keel.stages.base import ObjectiveOutput, Scored, Stage, StageSettings
from keel.train.objective import (
    CausalLMObjective,
    causal_lm_of,
    decoder_of,
    model_inputs,
    zero_through_model,
)


@dataclass(frozen=True, kw_only=True)
class TokenScoring:
    """How `target_logps` turns a model's hidden states into log-probs."""

    fast_head: bool  # output layer at target positions only, in chunks (else the HF forward)
    chunk_size: int
    vision: VisionFamily | None = None
    temperature: float = 1.0  # logits divided by it first (grpo: the sampling temperature)


def target_logps(model: nn.Module, batch: dict, how: TokenScoring, *, prefix: str = "") -> Tensor:
    """The log-prob of each target token of `batch`'s `prefix`ed sequences under `model`
    (an HF or PEFT causal LM), flat in row-major order of the targets: [N]."""
    lm = causal_lm_of(model)
    inputs = model_inputs(batch, prefix, vision=how.vision, config=lm.config)
    targets = batch[f"{prefix}targets"]  # [B, T]
    mask = targets != IGNORE_INDEX  # [B, T]
    if how.fast_head:
        out = decoder_of(lm, how.vision)(**inputs)
        head = lm.get_output_embeddings()
        logps = chunked_token_logps(
            out.last_hidden_state[mask],  # [N, H]
            targets[mask],
            head,
            chunk_size=how.chunk_size,
            temperature=how.temperature,
        )  # [N]
    else:
        head, out = None, model(**inputs)
        logps = token_logps(out.logits[mask], targets[mask], temperature=how.temperature)
    if CP_GROUP in inputs:  # a part without targets still runs the group's backward
        logps = logps + zero_through_model(out, head)
    return logps  # [N]


def score_sequences(
    model: nn.Module,
    batch: dict,
    *,
    prefix: str = "",
    fast_head: bool,
    chunk_size: int,
    vision: VisionFamily | None = None,
) -> Scored:
    """Each sequence's summed completion log-prob under `model` (an HF or PEFT causal LM,
    or a vision-language model of family `vision`).

    Sequences are numbered by `batch[prefix + "sequence_index"]` (see keel.data.collate);
    their count is the length of `labels`. No attention mask and no cache, as for SFT: rows
    are right-padded and packed sequences are separated by their restarting position ids.
    """
    head = TokenScoring(fast_head=fast_head, chunk_size=chunk_size, vision=vision)
    logps = target_logps(model, batch, head, prefix=prefix)  # [N]
    mask = batch[f"{prefix}targets"] != IGNORE_INDEX  # [B, T]
    sequence = batch[f"{prefix}sequence_index"][mask]  # [N]
    count = batch["labels"].shape[0]
    sums = logps.new_zeros(count).index_add(0, sequence, logps)
    counts = torch.bincount(sequence, minlength=count)
    group = batch.get("cp_group")
    if group is not None:  # context parallelism: this process holds a part of each sequence
        sums = group_sum(sums, group)
        counts = group_sum(counts, group)
    return Scored(sums=sums, counts=counts)


class SequenceScorer(nn.Module):
    """A frozen reference model that scores sequences (or their tokens). A module of its
    own so that, under FSDP, it is the root unit whose hooks gather the weights its forward
    uses."""

    def __init__(
        self,
        model: nn.Module,
        *,
        chunk_size: int,
        fast_head: bool,
        vision: VisionFamily | None = None,
    ):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.fast_head = fast_head
        self.vision = vision

    @torch.no_grad()
    def forward(
        self, batch: dict, prefix: str = "", *, tokens_at: float | None = None
    ) -> torch.Tensor:
        """Each sequence's summed log-prob [S]; with `tokens_at` (a temperature), each
        target token's log-prob at that temperature instead, flat [N] (grpo's KL term)."""
        if tokens_at is not None:
            how = TokenScoring(
                fast_head=self.fast_head,
                chunk_size=self.chunk_size,
                vision=self.vision,
                temperature=tokens_at,
            )
            return target_logps(self.model, batch, how, prefix=prefix)
        scored = score_sequences(
            self.model,
            batch,
            prefix=prefix,
            fast_head=self.fast_head,
            chunk_size=self.chunk_size,
            vision=self.vision,
        )
        return scored.sums


class PreferenceObjective(CausalLMObjective):
    """forward(batch) -> ObjectiveOutput(loss sum, pairs or samples, statistics [2 x metrics]).

    The objective of every stage whose unit is a pair or a labelled sample: it scores the
    sequences and hands them to the stage's loss (`Stage.pair_loss`, or KTO's for samples).

    The reference log-probs come, in this order of preference, from the batch (precomputed),
    from `reference` (a frozen copy of the base, for full and freeze), or from the policy
    with its LoRA adapters disabled (no second copy). ORPO and SimPO use none.

    KTO needs one number per global batch before any loss: its reference point z0, the
    mean KL log-ratio over the batch's mismatched pairs. The trainer gets it with
    forward(batch, mode="statistic") over every micro-batch and one all-reduce, then calls
    `set_window_statistic` (see `Trainer`).
    """

    reports_perplexity = False  # its eval loss is per pair, sample or completion

    needs_window_statistic = False

    def __init__(
        self,
        model: nn.Module,
        *,
        stage: Stage,
        settings: StageSettings,
        reference: SequenceScorer | None = None,
        chunk_size: int = 1024,
        vision: VisionFamily | None = None,
    ):
        super().__init__(model, chunk_size=chunk_size, vision=vision)
        assert stage.unit in ("pair", "sample"), f"{stage.name} does not score sequences"
        self.stage = stage
        self.settings = settings
        self.metric_names = stage.metric_names
        # labelled samples: KTO's reference point, over the global batch, before any loss
        self.needs_window_statistic = stage.unit == "sample"
        # a pair's chosen and rejected sequences share the prompt: computed once for both
        # (a vision-language model's images and 3-D positions keep the sequences whole)
        self.shares_pair_prompts = stage.unit == "pair" and vision is None
        # Not a submodule: its weights are neither trained, nor checkpointed, nor wrapped
        # by the policy's DDP/FSDP (it is sharded as its own root under FSDP).
        self._reference = (reference,)
        self.kl_reference_point = torch.zeros(())

    @property
    def reference(self) -> SequenceScorer | None:
        return self._reference[0]

    def set_window_statistic(self, value: float) -> None:
        """KTO's reference point z0 for the micro-batches that follow: max(0, mean KL)."""
        self.kl_reference_point = torch.tensor(max(0.0, value))

    def forward(self, batch: dict, *, probe: str | None = None, mode: str = "loss"):
        if probe:
            return super().forward(batch, probe=probe)
        if mode == "statistic":
            return self._kl_statistic(batch)
        if mode == "reference":
            return self._reference_logps(batch)
        policy = self._score(batch)
        reference = self._reference_sums(batch, "") if self.stage.uses_reference else None
        if self.stage.unit == "sample":
            return share_of_group(self._kto(batch, policy, reference), batch)
        return share_of_group(self._pairs(policy, reference), batch)

    def _score(self, batch: dict, prefix: str = "") -> Scored:
        return score_sequences(
            self.model,
            batch,
            prefix=prefix,
            fast_head=self.fast_head,
            chunk_size=self.chunk_size,
            vision=self.vision,
        )

    @torch.no_grad()
    def _reference_sums(self, batch: dict, prefix: str) -> torch.Tensor:
        key = "reference_kl_logps" if prefix else "reference_logps"
        if key in batch:
            return batch[key]
        if self.reference is not None:
            return self.reference(batch, prefix)
        with adapters_off(self.model):
            return self._score(batch, prefix).sums

    @torch.no_grad()
    def _reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What `reference: precompute` (dpo, kto) stores: the reference's per-sequence
        log-probs of the main and (KTO) mismatched sequences. Runs before training, so the
        policy still holds the base weights (and LoRA is switched off anyway)."""
        scorer = self.reference
        if scorer is None:
            # Without LoRA the policy itself is the reference here: nothing has trained yet.
            off = adapters_off if hasattr(self.model, "disable_adapter") else _unchanged
            with off(self.model):
                main = self._score(batch).sums
                kl = self._score(batch, "kl_").sums if "kl_input_ids" in batch else None
            return main, kl
        kl = scorer(batch, "kl_") if "kl_input_ids" in batch else None
        return scorer(batch), kl

    @torch.no_grad()
    def _kl_statistic(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) of KTO's KL log-ratios over this micro-batch's mismatched pairs."""
        policy = self._score(batch, "kl_").sums
        ratios = losses.kto_kl(policy, self._reference_sums(batch, "kl_"))
        count = torch.tensor(float(ratios.numel()), device=ratios.device)
        share = group_share(batch)
        return ratios.sum() * share, count * share

    def _pairs(self, policy: Scored, reference: torch.Tensor | None) -> ObjectiveOutput:
        out, chosen, rejected = self.stage.pair_loss(policy, reference, self.settings)
        pairs = out.losses.shape[0]
        every = torch.ones_like(out.losses, dtype=torch.bool)
        values = {
            "rewards/chosen": out.chosen_rewards,
            "rewards/rejected": out.rejected_rewards,
            "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float(),
            "rewards/margins": out.chosen_rewards - out.rejected_rewards,
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
            **out.extras,
        }
        stats = _statistics(self.metric_names, values, {name: every for name in values})
        return ObjectiveOutput(out.losses.sum(), torch.tensor(float(pairs)), stats)

    def _kto(self, batch: dict, policy: Scored, reference: torch.Tensor) -> ObjectiveOutput:
        s = self.settings
        desirable = batch["labels"] == 1  # [S]
        out = losses.kto_loss(
            policy.sums,
            reference,
            desirable,
            kl=self.kl_reference_point.to(policy.sums.device),
            beta=s.beta,
            desirable_weight=s.desirable_weight,
            undesirable_weight=s.undesirable_weight,
        )
        logps = policy.sums.detach()
        values = {
            "rewards/chosen": out.rewards,
            "rewards/rejected": out.rewards,
            "logps/chosen": logps,
            "logps/rejected": logps,
        }
        chosen_or_rejected = {
            name: desirable if name.endswith("chosen") else ~desirable for name in values
        }
        stats = _statistics(self.metric_names, values, chosen_or_rejected)
        return ObjectiveOutput(out.losses.sum(), torch.tensor(float(out.losses.shape[0])), stats)


def group_share(batch: dict) -> float:
    """1 / the processes of the batch's context-parallel group (1 without one)."""
    group = batch.get("cp_group")
    return 1.0 if group is None else 1.0 / torch.distributed.get_world_size(group)


def share_of_group(out: ObjectiveOutput, batch: dict) -> ObjectiveOutput:
    """This process's share of the output: under context parallelism every process of a
    group computes the same loss from the group's summed per-sequence values (log-probs,
    rm's scores), and weighs it (its count and statistics too) 1/C, so the group's parts
    add up to the micro-batch's as they do for pt and sft. The backward of the sums
    (`group_sum`) adds the group's 1/C gradients up, so each process gets the whole loss's
    gradient for its own tokens."""
    share = group_share(batch)
    if share == 1.0:
        return out
    statistics = None if out.statistics is None else out.statistics * share
    return ObjectiveOutput(out.loss * share, out.count * share, statistics)


def _statistics(
    names: tuple[str, ...], values: dict[str, torch.Tensor], where: dict[str, torch.Tensor]
) -> torch.Tensor:
    """[2 x len(names)]: (sum, count) of each named per-sequence value over its selection."""
    parts = []
    for name in names:
        selected = where[name]
        parts += [values[name].detach().float()[selected].sum(), selected.sum().float()]
    return torch.stack(parts)


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model under a PEFT model: its LoRA adapters switched off for the block."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise RuntimeError(
            "a live reference without LoRA needs a frozen reference copy (internal error)"
        )
    with disable():
        yield


@contextlib.contextmanager
def _unchanged(_model: nn.Module):
    yield


def reduce_statistics(names: tuple[str, ...], sums_and_counts: list[float]) -> dict[str, float]:
    """Named means from a reduced statistics vector; a name with no samples is left out
    (e.g. a KTO step without undesirable samples has no rewards/rejected)."""
    out = {}
    for i, name in enumerate(names):
        total, count = sums_and_counts[2 * i], sums_and_counts[2 * i + 1]
        if count > 0:
            out[name] = total / count
    if "rewards/margins" not in names and {"rewards/chosen", "rewards/rejected"} <= out.keys():
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
