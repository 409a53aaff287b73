"""The preflight's checks of a stage trained on prompts answered online (grpo)."""

from __future__ import annotations

from pathlib import Path

import torch

from keel.config import RunConfig
from keel.errors import ConfigError
from keel.rewards import RewardFunction, load_rewards
from keel.stages.registry import get_stage


def online_rl_checks(
    cfg: RunConfig, base_dir: Path, device: torch.device
) -> tuple[list[RewardFunction], list[str]]:
    """A stage trained on prompts answered online (grpo): its reward functions, loaded here
    (before any model or data), and the settings it cannot train with (data.packing is
    refused with the config, keel.config.validate)."""
    if get_stage(cfg.train.stage).unit != "prompt":
        return [], []
    stage, problems = cfg.train.stage, []
    if cfg.data.val_size or cfg.data.eval_datasets:
        setting = (
            f"data.val_size = {cfg.data.val_size!r}" if cfg.data.val_size else "data.eval_datasets"
        )
        problems.append(
            f"{setting}: {stage} has no eval loss (its loss depends on sampled completions); "
            "leave the evaluation data out and score held-out prompts with the trained model "
            "instead (keel chat, or a reward over them)"
        )
    problems += _iteration_problems(cfg)
    try:
        rewards = load_rewards(cfg.stage_settings.rewards, base_dir, device=str(device))
    except ConfigError as exc:
        return [], problems + exc.problems
    return rewards, problems


def _iteration_problems(cfg: RunConfig) -> list[str]:
    """num_iterations > 1: a rollout trains that many steps, so the run's length is set in
    steps (a checkpoint may fall anywhere: inside a span it holds the rollout)."""
    mu, stage = cfg.stage_settings.num_iterations, cfg.train.stage
    if mu == 1 or cfg.train.max_steps is not None:
        return []
    return [
        f"{stage}.num_iterations = {mu} needs train.max_steps: each rollout trains {mu} "
        f"steps, so train.epochs does not say how many steps the run has"
    ]
