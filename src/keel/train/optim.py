"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norm weights (1-D) get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    assert groups, "no trainable parameters"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)


def warmup_steps_for(cfg: TrainConfig, total_steps: int) -> int:
    if cfg.warmup_steps:
        return min(cfg.warmup_steps, total_steps)
    return int(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, *, total_steps: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based).

    Linear warmup over `warmup` steps, then cosine to 0, linear to 0, or constant.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    progress = min(1.0, progress)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps_for(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, total_steps=total_steps, warmup=warmup, kind=cfg.scheduler),
    )
