"""Per-sequence sampling: greedy at temperature 0, else temperature + top-p with its own seed."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request chooses its tokens; already validated against the server's limits."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # token ids never chosen (grpo on a vision-language model: its image tokens, which a
    # completion must not hold: the model would look for image features for them)
    banned: tuple[int, ...] = ()


def without_banned(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` [B, V] with row b's banned tokens (params[b].banned) at -inf; the same
    tensor when no row bans any."""
    rows = [(row, p.banned) for row, p in enumerate(params) if p.banned]
    if not rows:
        return logits
    logits = logits.clone()
    for row, banned in rows:
        logits[row, list(banned)] = float("-inf")
    return logits


def make_generator(params: SamplingParams, choice: int) -> torch.Generator | None:
    """A CPU generator for one choice; choice i of a seeded request uses seed + i, so `n`
    choices differ from each other yet the same request gives the same answers again.
    Seeds wrap around at 64 bits, the generator's range."""
    if params.temperature == 0:
        return None
    seed = params.seed + choice if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed % 2**64)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The most likely token of each row of `logits` [B, V] (one transfer for the batch)."""
    return logits.argmax(dim=-1).tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token drawn from `logits` [V] at the row's temperature and top-p; ValueError if
    the probabilities are not finite (the row ends, the batch goes on)."""
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)  # [V]
    order = None
    if params.top_p < 1.0:
        probs, order = probs.sort(descending=True)  # [V], [V]
        # Keep the smallest head whose mass reaches top_p; the first token always stays.
        mass_before = probs.cumsum(0) - probs
        drop = mass_before >= params.top_p  # a top_p below float32's range rounds to 0
        drop[0] = False
        probs[drop] = 0.0
    picked = draw(probs, generator)
    return picked if order is None else int(order[picked])


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn with probability proportional to `weights` [V] (>= 0), by inverting
    their cumulative sum at one uniform number from `generator`; ValueError if the weights
    are not finite numbers with a positive sum.

    The same distribution as torch.multinomial(weights, 1), ~25x faster for one draw over
    a 50k vocabulary on a CPU (multinomial prepares for many draws; a rollout step makes
    one per sequence per token). Float64 sums, so no token's share is lost to round-off."""
    cumulative = weights.double().cumsum(0)  # [V]
    total = float(cumulative[-1])  # NaN or inf if any weight is: a softmax of bad logits
    if not (math.isfinite(total) and total > 0):
        raise ValueError(
            "the next-token probabilities are not finite numbers with a positive sum "
            f"(their sum is {total}); the logits hold NaN or inf"
        )
    point = torch.rand((), dtype=torch.float64, generator=generator) * total
    index = int(torch.searchsorted(cumulative, point, right=True))  # first sum above point
    if index >= weights.numel():  # point rounded up to the total: the last drawable token
        index = int(torch.nonzero(weights).max())
    return index
