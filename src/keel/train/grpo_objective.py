"""The grpo stage's objective: the clipped policy gradient over rollout rows.

A rollout micro-batch (keel.data.collate's rollout branch) holds prompts each followed by
one sampled completion; targets are the completion's tokens only. Each target token gets
its log-prob under the policy at the sampling temperature (TRL divides the logits by it
too, so the ratio is that of the distribution the tokens were drawn from), the advantage of
its completion, and the log-prob it was sampled with: the batch's `old_logps` when the
rollout is reused for several updates (num_iterations > 1), else the current log-prob
detached, so the ratio is 1 and only the gradient carries signal. keel.losses.grpo turns
those into per-token losses and the micro-batch's loss SUM; the trainer divides by the
global batch's completions (grpo, dr_grpo) or completion tokens (dapo).

Under context parallelism (keel.distributed.context_parallel) each process holds a part of
every row's tokens: its token losses are its part's, grpo's mean over a completion divides
by the completion's tokens over the whole group, and each process counts a completion 1/C.

With beta > 0 the k3 KL to a reference is added per token: the policy with its LoRA
adapters off, or the frozen copy model set-up attaches (full and freeze), both scored at
the same temperature.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.distributed.context_parallel import group_sum
from keel.losses.causal_lm import IGNORE_INDEX
from keel.losses.grpo import TokenLosses, aggregate, loss_unit, policy_token_losses
from keel.models.vision.family import VisionFamily
from keel.stages.base import ObjectiveOutput
from keel.stages.grpo import CLIP_METRICS, GrpoSettings
from keel.train.objective import CausalLMObjective
from keel.train.preference import (
    SequenceScorer,
    TokenScoring,
    adapters_off,
    group_share,
    target_logps,
)


class PolicyGradientObjective(CausalLMObjective):
    """forward(batch) -> ObjectiveOutput(loss sum, completions or completion tokens,
    statistics [2 x metrics]): (sum, count) over completion tokens of each clip fraction,
    and of the KL estimate when beta > 0."""

    reports_perplexity = False  # its eval loss is per pair, sample or completion

    needs_window_statistic = False

    def __init__(
        self,
        model: nn.Module,
        *,
        settings: GrpoSettings,
        reference: SequenceScorer | None = None,
        chunk_size: int = 1024,
        vision: VisionFamily | None = None,
    ):
        super().__init__(model, chunk_size=chunk_size, vision=vision)
        self.settings = settings
        self.metric_names = CLIP_METRICS + (("kl",) if settings.beta > 0 else ())
        # Not a submodule: its weights are neither trained, nor checkpointed, nor wrapped
        # by the policy's DDP/FSDP (model set-up attaches it for full and freeze).
        self._reference = (reference,)

    @property
    def reference(self) -> SequenceScorer | None:
        return self._reference[0]

    def set_window_statistic(self, value: float) -> None:
        raise AssertionError("grpo needs no window statistic")

    def forward(self, batch: dict, *, probe: str | None = None, mode: str | None = None):
        if probe:
            return super().forward(batch, probe=probe)
        if mode == "token_logps":  # the rollout's old log-probs [N] (keel.train.rollouts)
            return self._token_logps(batch)
        s = self.settings
        mask = batch["targets"] != IGNORE_INDEX  # [B, T]
        sequence = batch["sequence_index"][mask]  # [N]
        advantages = batch["advantages"]  # [S]
        kept = batch["kept"][sequence] > 0 if "kept" in batch else None  # [N] bool
        logps = self._token_logps(batch)  # [N]
        old = batch["old_logps"][mask] if "old_logps" in batch else logps.detach()  # [N]
        reference = self._reference_logps(batch) if s.beta > 0 else None  # [N]
        out = policy_token_losses(
            logps,
            old,
            advantages[sequence],
            epsilon_low=s.epsilon,
            epsilon_high=s.clip_high,
            ref_logps=reference,
            beta=s.beta,
        )
        if kept is not None:  # masked completions: weight 0, in no count (TRL's mask)
            out = _only_kept(out, kept)
        completions = advantages.shape[0]
        group = batch.get("cp_group")
        counts = None
        if group is not None and s.loss_type == "grpo":  # a completion's tokens, every part's
            counts = group_sum(torch.bincount(sequence, minlength=completions), group)
        loss = aggregate(
            s.loss_type, out.losses, sequence, completions, s.max_completion_length, counts
        )
        tokens = logps.shape[0] if kept is None else kept.sum()
        if loss_unit(s.loss_type) == "completions":
            # every process of a context-parallel group holds each completion (a part of it)
            share = float(completions) * group_share(batch)
            count = torch.tensor(share, device=loss.device)
        else:
            count = torch.as_tensor(tokens, device=loss.device)
        return ObjectiveOutput(loss, count, self._statistics(out, tokens))

    def _token_logps(self, batch: dict) -> torch.Tensor:
        how = TokenScoring(
            fast_head=self.fast_head,
            chunk_size=self.chunk_size,
            vision=self.vision,
            temperature=self.settings.temperature,
        )
        return target_logps(self.model, batch, how)

    @torch.no_grad()
    def _reference_logps(self, batch: dict) -> torch.Tensor:
        """The reference's log-prob of each target token [N]: the frozen copy, else the
        policy with its LoRA adapters off."""
        if self.reference is not None:
            return self.reference(batch, tokens_at=self.settings.temperature)
        with adapters_off(self.model):
            return self._token_logps(batch)

    def _statistics(self, out: TokenLosses, tokens: int) -> torch.Tensor:
        """[2 x len(metric_names)]: (clipped tokens, tokens) of each clip fraction, then
        (summed KL, tokens) when beta > 0."""
        count = torch.as_tensor(tokens, dtype=torch.float32, device=out.losses.device)
        values = [out.low_clipped, out.high_clipped, out.low_clipped | out.high_clipped]
        if "kl" in self.metric_names:
            values.append(out.kl)
        parts = []
        for value in values:
            parts += [value.detach().float().sum(), count]
        return torch.stack(parts)


def _only_kept(out: TokenLosses, kept: torch.Tensor) -> TokenLosses:
    """`out` with the tokens of masked completions weighed 0 (their losses times zero, so
    the graph still reaches every parameter) and left out of the clip and KL statistics."""
    return TokenLosses(
        losses=out.losses * kept,
        low_clipped=out.low_clipped & kept,
        high_clipped=out.high_clipped & kept,
        kl=None if out.kl is None else out.kl * kept,
    )
