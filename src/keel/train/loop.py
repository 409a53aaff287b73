"""The one training loop, shared by every stage.

A step is one optimizer update over an accumulation window of micro-batches. Which rows a
step uses is a pure function of (step, seed): resuming needs only the step number.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from keel.data import collate, epoch_order
from keel.train.precision import Precision


@dataclass(frozen=True)
class StepPlan:
    """Maps optimizer steps to micro-batches of row indices. Windows never cross epochs."""

    num_rows: int
    micro_batch_size: int
    grad_accum: int
    seed: int
    shuffle: bool

    @property
    def micro_batches_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.micro_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_epoch / self.grad_accum)

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        return max(1, math.ceil(epochs * self.steps_per_epoch))

    def window(self, step: int) -> list[list[int]]:
        """Row indices of each micro-batch of optimizer step `step` (0-based)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        first = index * self.grad_accum * self.micro_batch_size
        last = min(first + self.grad_accum * self.micro_batch_size, self.num_rows)
        return [order[i:i + self.micro_batch_size]
                for i in range(first, last, self.micro_batch_size)]

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    @lru_cache(maxsize=2)  # noqa: B019 - the plan is immutable and lives as long as the run
    def _order(self, epoch: int) -> list[int]:
        return epoch_order(self.num_rows, epoch, self.seed, self.shuffle)


@dataclass
class StepResult:
    loss: float  # mean CE per target token over the whole window
    grad_norm: float
    lr: float
    target_tokens: int
    real_tokens: int  # non-padding input tokens
    seconds: float


@dataclass
class Trainer:
    """Runs optimizer steps and evaluations for one objective."""

    objective: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    device: torch.device
    pad_id: int
    max_grad_norm: float
    trainable: list[nn.Parameter] = field(init=False)

    def __post_init__(self):
        self.trainable = [p for p in self.objective.parameters() if p.requires_grad]
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.precision.name == "fp16")

    def _batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True)
                for k, v in collate(rows, self.pad_id).items()}

    def train_step(self, micro_batches: list[list[dict]]) -> StepResult:
        """One optimizer update. The loss is normalised by the target tokens of the whole
        window, so each token weighs the same whatever micro-batch it is in."""
        start = time.perf_counter()
        self.objective.train()
        window_targets = sum(row["num_targets"] for rows in micro_batches for row in rows)
        real_tokens = sum(len(row["input_ids"]) for rows in micro_batches for row in rows)
        loss_sum = 0.0
        for rows in micro_batches:
            batch = self._batch(rows)
            with self.precision.autocast(self.device):
                micro_loss, _ = self.objective(batch)
            loss = micro_loss / max(window_targets, 1)
            self.scaler.scale(loss).backward()
            loss_sum += micro_loss.item()
        self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=loss_sum / max(window_targets, 1), grad_norm=grad_norm, lr=lr,
                          target_tokens=window_targets, real_tokens=real_tokens,
                          seconds=time.perf_counter() - start)

    def _clip(self) -> float:
        if self.max_grad_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm))
        grads = [p.grad.detach().norm() for p in self.trainable if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0

    @torch.no_grad()
    def evaluate(self, rows: list[dict], micro_batch_size: int) -> dict[str, float]:
        """Mean CE per target token over all eval rows, and its perplexity."""
        self.objective.eval()
        total, count = 0.0, 0
        for i in range(0, len(rows), micro_batch_size):
            with self.precision.autocast(self.device):
                loss_sum, n = self.objective(self._batch(rows[i:i + micro_batch_size]))
            total += loss_sum.item()
            count += int(n)
        loss = total / max(count, 1)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


StepCallback = Callable[[int, dict], None]
