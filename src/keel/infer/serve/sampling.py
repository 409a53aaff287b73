"""Per-sequence sampling: greedy at temperature 0, else temperature + top-p with its own seed."""

from __future__ import annotations

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
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(
            f"the next-token probabilities at temperature {params.temperature:g} are not "
            "finite numbers"
        )
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)  # [V], [V]
        # Keep the smallest head whose mass reaches top_p; the first token always stays.
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        drop = mass_before >= params.top_p  # a top_p below float32's range rounds to 0
        drop[0] = False
        sorted_probs[drop] = 0.0
        picked = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[picked])
    return int(torch.multinomial(probs, 1, generator=generator))
