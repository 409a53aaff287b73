"""Causal-LM cross-entropy, summed over target tokens.

Losses here return a *sum* over target tokens, never a mean: the trainer divides by the
number of target tokens in the whole accumulation window (and, distributed, across ranks),
so every token weighs the same whatever micro-batch it landed in. A mean of per-micro-batch
means would over-weight tokens in short micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum_i -log softmax(logits_i)[targets_i] over targets != -100, computed in fp32.

    logits [..., V], targets [...] (already aligned: targets[i] is what position i predicts).
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@dataclass(frozen=True)
class TokenWeighting:
    """train.token_weighting: each target token's cross-entropy times a weight computed from
    the model's own next-token distribution at that position, held constant (no gradient
    flows through it).

    - dft (Dynamic Fine-Tuning, Wu et al. 2025): the probability the model gives the target,
      p = exp(-CE). Tokens the model already finds likely weigh most, which the paper reads
      as SFT's gradient with its implicit 1/p reward weighting taken out.
    - eaft (entropy-adaptive): the entropy of the model's `top_k` most likely next tokens
      over its maximum, ln(top_k), to the power `alpha`: weights in [0, 1], near 0 where the
      model is sure (a confident conflict with the data is not forced), near 1 where it is
      unsure.
    """

    kind: Literal["dft", "eaft"]
    alpha: float = 1.0  # eaft's exponent
    top_k: int = 20  # eaft: the next tokens whose entropy is taken (>= 2)

    @torch.no_grad()
    def weights(self, logits: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        """[N] weights of positions with fp32 `logits` [N, V] and cross-entropies [N]."""
        if self.kind == "dft":
            return torch.exp(-losses)
        top = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values  # [N, k]
        log_probs = top.log_softmax(dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
        return (entropy / math.log(self.top_k)).pow(self.alpha)


def weighted_cross_entropy_sums(
    logits: torch.Tensor, targets: torch.Tensor, weighting: TokenWeighting
) -> torch.Tensor:
    """[2]: (sum_i w_i * CE_i, sum_i CE_i detached) over targets != -100, in fp32; w_i from
    `weighting` (see TokenWeighting). The second is what the run logs as ce_loss.

    Positions without a target keep a cross-entropy of 0 (ignore_index) rather than being
    selected out: selecting would copy the logits, a whole chunk of [positions, vocabulary]
    on the fast head, where every position already has a target."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1)
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    weights = weighting.weights(logits.detach(), losses.detach())
    return torch.stack([(weights * losses).sum(), losses.detach().sum()])


def _head_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return cross_entropy_sum(head(hidden), targets)


def _head_weighted_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weighting: TokenWeighting,
) -> torch.Tensor:
    return weighted_cross_entropy_sums(head(hidden), targets, weighting)


def _head_token_logps(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    return token_logps(head(hidden), targets, temperature=temperature)


def _by_chunks(loss_of_chunk, hidden, targets, head, chunk_size: int, *extra) -> list[torch.Tensor]:
    """`loss_of_chunk(head, h, t, *extra)` for each chunk of `chunk_size` positions,
    checkpointed when it will be differentiated (backward recomputes the chunk's logits)."""
    assert hidden.shape[0] == targets.shape[0], (hidden.shape, targets.shape)
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]  # [c, H]
        t = targets[start : start + chunk_size]  # [c]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(loss_of_chunk, head, h, t, *extra, use_reentrant=False))
        else:
            parts.append(loss_of_chunk(head, h, t, *extra))
    return parts


def chunked_cross_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` against `targets`, chunk by chunk.

    hidden [N, H] (only the positions that have a target), targets [N]. Each chunk's logits
    [chunk, V] are computed, reduced to a scalar and dropped; backward recomputes them
    (activation checkpointing), so peak memory holds one chunk of logits instead of N x V.
    With a 49k vocabulary and 2k tokens that is ~0.4 GB of fp32 logits (plus their
    softmax and gradient) reduced to one chunk's worth.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for part in _by_chunks(_head_cross_entropy, hidden, targets, head, chunk_size):
        total = total + part
    return total


def chunked_weighted_cross_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    weighting: TokenWeighting,
    *,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """`weighted_cross_entropy_sums` of `head(hidden)`, chunk by chunk as
    `chunked_cross_entropy` computes the plain one: [2] (weighted sum, plain sum)."""
    total = hidden.new_zeros((2,), dtype=torch.float32)
    chunks = _by_chunks(_head_weighted_cross_entropy, hidden, targets, head, chunk_size, weighting)
    for part in chunks:
        total = total + part
    return total


def token_logps(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits_i / temperature)[targets_i] for each position, in fp32. logits
    [N, V], targets [N] (every target real: select the target positions first).

    The temperature is the one the tokens were sampled at (GRPO: the policy's log-probs of
    its own samples, as TRL takes them); the logits are divided in fp32, as TRL divides them.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return -F.cross_entropy(logits, targets, reduction="none")


def chunked_token_logps(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position log-probs of `targets` under `head(hidden) / temperature`, chunk by
    chunk: [N] (see `token_logps`).

    The per-token counterpart of `chunked_cross_entropy` (same memory behaviour: one chunk's
    logits at a time, recomputed in backward); preference losses need each sequence's sum.
    """
    parts = _by_chunks(_head_token_logps, hidden, targets, head, chunk_size, temperature)
    if not parts:
        return hidden.new_zeros((0,), dtype=torch.float32)
    return torch.cat(parts)
