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
    choices differ from each other yet the same request gives the same answers again."""
    if params.temperature == 0:
        return None
    seed = params.seed + choice if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


def pick_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """The next token of each row of `logits` [B, V] under that row's params."""
    chosen = logits.argmax(dim=-1).tolist()  # greedy for every row; sampled rows overwrite
    for row, (param, generator) in enumerate(zip(params, generators)):
        if param.temperature > 0:
            chosen[row] = _sample(logits[row], param, generator)
    return chosen


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)  # [V], [V]
        # Keep the smallest head whose mass reaches top_p; the first token always stays.
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[mass_before >= params.top_p] = 0.0
        picked = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[picked])
    return int(torch.multinomial(probs, 1, generator=generator))
