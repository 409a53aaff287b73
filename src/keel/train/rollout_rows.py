"""Where a GRPO step's prompts go and what its rows are: the sampling seed of each prompt,
each data-parallel rank's contiguous block of the window, the units of it each process of a
context-parallel group samples (and their scored completions joined back in block order),
and a completion as a trainable row (targets pre-shifted onto the completion's tokens) with
its per-token values read back from a micro-batch; a vision-language run's prompt images, for
the generation engine and through a checkpoint. Pure functions of their arguments;
keel.train.rollouts uses them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from keel.data.shared_prompt import PROMPT_LEN, can_share, unshare
from keel.errors import ConfigError
from keel.infer.vision import stored_image_prompt
from keel.stages.registry import get_stage

if TYPE_CHECKING:
    from keel.infer.batch_generate import Completion

NO_TARGET = -100
IMAGES = "image_blobs"  # a vision-language run's rows: their prompt's prepared images


@dataclass(kw_only=True)
class ScoredPrompts:
    """Prompts after generation and scoring (a rank's block, or a part of it), in prompt
    order, G completions each."""

    prompts: list[int]  # prompt row indices
    completions: list[Completion]
    scores: torch.Tensor  # [N, F] float32, NaN: unscorable
    rewards: torch.Tensor  # [N] weighted sum (NaN where every function abstained)
    advantages: torch.Tensor  # [N]
    texts: list[str]
    seconds: float  # generation time
    # what the reward functions logged (keel.rewards.RewardLog): each sample column's
    # values, one per completion, and each metric's (sum, count) over this process's calls
    extras: dict[str, list] = field(default_factory=dict)
    logged: dict[str, tuple[float, int]] = field(default_factory=dict)


def sample_seed(seed: int, generation_step: int, row: int) -> int:
    """The sampling seed of prompt row `row` at generation step `generation_step`: a stable
    hash (never Python's salted hash(), never the rank); completion j draws from seed + j."""
    digest = hashlib.blake2b(f"{seed}/{generation_step}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # room for + j below torch's 2**64 bound


def rank_block(window: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """Data-parallel rank `dp_rank`'s contiguous share of the window's prompts."""
    size = math.ceil(len(window) / dp_size)
    return window[dp_rank * size : (dp_rank + 1) * size]


def generation_units(block: list[int], unit: int) -> list[list[int]]:
    """`block`'s prompts in units of `unit` (grpo.generation_batch_prompts), each generated
    on its own: the completions of a prompt do not depend on which process samples it."""
    return [block[first : first + unit] for first in range(0, len(block), unit)]


def units_of_part(units: list[list[int]], cp_rank: int, cp_size: int) -> list[int]:
    """The prompts process `cp_rank` of a context-parallel group samples and scores: every
    cp_size-th unit from its own (the whole block without a group). Only the last unit may
    be short, so this process's units keep their boundaries when it samples its prompts."""
    return [row for unit in units[cp_rank::cp_size] for row in unit]


def refuse_uneven_prompts(stage: str, global_batch: int, dp_size: int) -> None:
    """A stage trained on prompts (grpo) gives each data-parallel process an equal,
    contiguous block of a step's prompts, so that a group of completions lies on one process
    and every process does the same work: refuse a global batch that does not divide."""
    if get_stage(stage).unit != "prompt" or global_batch % dp_size == 0:
        return
    lower = max(dp_size, global_batch - global_batch % dp_size)
    raise ConfigError(
        [
            f"train.global_batch_size = {global_batch} prompts is not a multiple of the "
            f"{dp_size} data-parallel processes: {stage} gives each process an equal block "
            f"of prompts; use {lower} or {lower + dp_size}"
        ]
    )


def rollout_row(
    prompt: dict, completion_ids: list[int], advantage: float, *, trained: bool
) -> dict:
    """A ROLLOUT row: prompt + completion, targets pre-shifted onto the completion's tokens.

    A completion that is not `trained` (truncated, under mask_truncated_completions) keeps
    its targets but has `kept` [0.0]: the objective weighs its tokens 0 and leaves them out of
    every count. Its log-probs are still computed, so every micro-batch's loss reaches every
    parameter the forward uses (a micro-batch of only such rows would otherwise have no
    graph to run backward through, and DDP would wait for gradients that never come).
    `num_targets` counts the trained target tokens (dapo's unit). `prompt_len` lets a
    padding-free micro-batch compute a prompt once for all its completions
    (keel.data.shared_prompt).

    `prompt` is the prompt row (input_ids; a vision-language run's image_blobs and, for
    M-RoPE families, rope_positions): the row keeps the prompt's images, and its positions
    go on from the prompt's largest for the completion's text tokens, as the family's do.
    Such a row has no `prompt_len`: its sequences stay whole (the images are each one's)."""
    prompt_ids = list(prompt["input_ids"])
    ids = [*prompt_ids, *completion_ids]
    targets = [NO_TARGET] * len(ids)
    targets[len(prompt_ids) - 1 : len(ids) - 1] = completion_ids
    row = {
        "input_ids": ids,
        "targets": targets,
        "position_ids": list(range(len(ids))),
        "num_targets": len(completion_ids) if trained else 0,
        "advantages": [float(advantage)],
        "kept": [1.0 if trained else 0.0],
    }
    if IMAGES not in prompt:
        return {**row, PROMPT_LEN: len(prompt_ids)}
    row[IMAGES] = list(prompt[IMAGES])
    rope = prompt.get("rope_positions")
    if rope is not None:
        following = max(rope) + 1
        row["rope_positions"] = [
            *rope,
            *(p for k in range(len(completion_ids)) for p in (following + k,) * 3),
        ]
    return row


def image_prompt(prompt: dict, config):
    """A prompt row's images as the generation engine takes them (keel.infer.vision's
    ImagePrompt: forward inputs and M-RoPE positions); None for a prompt without images."""
    return stored_image_prompt(prompt, config) if prompt.get(IMAGES) else None


def without_images(row: dict) -> dict:
    """A rollout row as a checkpoint saves it: its images are its prompt's (prepared data,
    not JSON), found again by `with_prompt_images`."""
    return {key: value for key, value in row.items() if key != IMAGES}


def with_prompt_images(rows: list[dict], prompt: dict) -> None:
    """Give saved rollout rows of `prompt` (a prompt row) its images back, in place."""
    images = prompt.get(IMAGES)
    if images is not None:
        for row in rows:
            row[IMAGES] = list(images)


def per_row(logps: torch.Tensor, rows: list[dict], padding_free: bool) -> list[list[float]]:
    """Split a micro-batch's [B, T] per-token values back into its rows (padded: row b is
    batch row b; padding-free: batch row 0 holds them, each prompt once, as
    keel.data.shared_prompt lays them out, or end to end)."""
    if padding_free and can_share(rows):
        return unshare(logps[0].float().cpu().tolist(), rows)
    values, start = [], 0
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        line = logps[0, start : start + n] if padding_free else logps[b, :n]
        values.append(line.float().cpu().tolist())
        start += n
    return values


def join_parts(units: list[list[int]], parts: list[ScoredPrompts], group: int) -> ScoredPrompts:
    """A block scored in parts (`units_of_part`: part r holds units r, r + C, ... of
    `units`, in order) as one, in block order; `group` completions per prompt."""
    pieces: list[ScoredPrompts] = []
    taken = [0] * len(parts)  # prompts of each part used so far
    for index, unit in enumerate(units):
        part, first = parts[index % len(parts)], taken[index % len(parts)]
        taken[index % len(parts)] += len(unit)
        pieces.append(_prompts_of(part, first, len(unit), group))
    tensors = {
        name: torch.cat([getattr(p, name) for p in pieces]) if pieces else getattr(parts[0], name)
        for name in ("scores", "rewards", "advantages")
    }
    columns = sorted({name for part in parts for name in part.extras})
    return ScoredPrompts(
        prompts=[row for piece in pieces for row in piece.prompts],
        completions=[c for piece in pieces for c in piece.completions],
        texts=[text for piece in pieces for text in piece.texts],
        seconds=max(part.seconds for part in parts),
        # a column one process's reward calls logged and another's did not: None there
        extras={
            name: [v for p in pieces for v in p.extras.get(name, [None] * len(p.texts))]
            for name in columns
        },
        **tensors,
    )


def _prompts_of(part: ScoredPrompts, first: int, count: int, group: int) -> ScoredPrompts:
    """Prompts first .. first + count - 1 of `part`, with their `group` completions each."""
    lo, hi = first * group, (first + count) * group
    return ScoredPrompts(
        prompts=part.prompts[first : first + count],
        completions=part.completions[lo:hi],
        scores=part.scores[lo:hi],
        rewards=part.rewards[lo:hi],
        advantages=part.advantages[lo:hi],
        texts=part.texts[lo:hi],
        seconds=part.seconds,
        extras={name: values[lo:hi] for name, values in part.extras.items()},
    )
