"""Where a GRPO step's prompts go and what its rows are: the sampling seed of each prompt,
each data-parallel rank's contiguous block of the window, and a completion as a trainable
row (targets pre-shifted onto the completion's tokens) with its per-token values read back
from a micro-batch. Pure functions of their arguments; keel.train.rollouts uses them.
"""

from __future__ import annotations

import hashlib
import math

import torch

from keel.data.shared_prompt import PROMPT_LEN, can_share, unshare
from keel.errors import ConfigError
from keel.stages.registry import get_stage

NO_TARGET = -100


def sample_seed(seed: int, generation_step: int, row: int) -> int:
    """The sampling seed of prompt row `row` at generation step `generation_step`: a stable
    hash (never Python's salted hash(), never the rank); completion j draws from seed + j."""
    digest = hashlib.blake2b(f"{seed}/{generation_step}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # room for + j below torch's 2**64 bound


def rank_block(window: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """Data-parallel rank `dp_rank`'s contiguous share of the window's prompts."""
    size = math.ceil(len(window) / dp_size)
    return window[dp_rank * size : (dp_rank + 1) * size]


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
    prompt_ids: list[int], completion_ids: list[int], advantage: float, *, trained: bool
) -> dict:
    """A ROLLOUT row: prompt + completion, targets pre-shifted onto the completion's tokens.

    A completion that is not `trained` (truncated, under mask_truncated_completions) keeps
    its targets but has `kept` [0.0]: the objective weighs its tokens 0 and leaves them out of
    every count. Its log-probs are still computed, so every micro-batch's loss reaches every
    parameter the forward uses (a micro-batch of only such rows would otherwise have no
    graph to run backward through, and DDP would wait for gradients that never come).
    `num_targets` counts the trained target tokens (dapo's unit). `prompt_len` lets a
    padding-free micro-batch compute a prompt once for all its completions
    (keel.data.shared_prompt)."""
    ids = [*prompt_ids, *completion_ids]
    targets = [NO_TARGET] * len(ids)
    targets[len(prompt_ids) - 1 : len(ids) - 1] = completion_ids
    return {
        "input_ids": ids,
        "targets": targets,
        "position_ids": list(range(len(ids))),
        PROMPT_LEN: len(prompt_ids),
        "num_targets": len(completion_ids) if trained else 0,
        "advantages": [float(advantage)],
        "kept": [1.0 if trained else 0.0],
    }


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
