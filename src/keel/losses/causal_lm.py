"""Causal-LM cross-entropy, summed over target tokens.

Losses here return a *sum* over target tokens, never a mean: the trainer divides by the
number of target tokens in the whole accumulation window (and, distributed, across ranks),
so every token weighs the same whatever micro-batch it landed in. A mean of per-micro-batch
means would over-weight tokens in short micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _head_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return cross_entropy_sum(head(hidden), targets)


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
    assert hidden.shape[0] == targets.shape[0], (hidden.shape, targets.shape)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]  # [c, H]
        t = targets[start : start + chunk_size]  # [c]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_head_cross_entropy, head, h, t, use_reentrant=False)
        else:
            total = total + _head_cross_entropy(head, h, t)
    return total
