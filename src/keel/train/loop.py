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
from keel.distributed.parallelize import full_value, gradient_sync
from keel.distributed.process_group import DistContext
from keel.train.precision import Precision


@dataclass(frozen=True)
class StepPlan:
    """Maps optimizer steps to rows, and each process's share to micro-batches.

    A step's global batch is `global_batch` consecutive rows of the epoch's order, whatever
    the number of processes; windows never cross epochs. Process r takes every world-th row
    of it, and every process runs the same number of micro-batches: a process with fewer
    rows gets empty micro-batches, which the trainer runs as zero-weight filler so that all
    processes make the same collective calls (uneven remainders never hang a run).
    """

    num_rows: int
    global_batch: int
    micro_batch_size: int
    seed: int
    shuffle: bool

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.global_batch)

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        return max(1, math.ceil(epochs * self.steps_per_epoch))

    def window(self, step: int) -> list[int]:
        """Row indices of optimizer step `step`'s global batch (0-based step)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        first = index * self.global_batch
        return self._order(epoch)[first:min(first + self.global_batch, self.num_rows)]

    def micro_batches(self, step: int, rank: int = 0, world_size: int = 1) -> list[list[int]]:
        """This process's micro-batches of step `step`; empty lists are filler."""
        return split_for_rank(self.window(step), rank, world_size, self.micro_batch_size)

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    @lru_cache(maxsize=2)  # noqa: B019 - the plan is immutable and lives as long as the run
    def _order(self, epoch: int) -> list[int]:
        return epoch_order(self.num_rows, epoch, self.seed, self.shuffle)


def split_for_rank(rows: list, rank: int, world_size: int, micro_batch_size: int) -> list[list]:
    """Rank `rank`'s micro-batches of `rows`; the same count on every rank (padded with [])."""
    mine = rows[rank::world_size]
    count = max(1, math.ceil(math.ceil(len(rows) / world_size) / micro_batch_size))
    return [mine[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(count)]


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
    """Runs optimizer steps and evaluations for one objective, on one or many processes.

    `objective` may be wrapped for data parallelism (DDP) or hold sharded parameters
    (FSDP2); both average gradients over processes, which the loss scaling undoes so that
    N processes compute exactly the update one process computes on the same global batch.
    """

    objective: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    device: torch.device
    pad_id: int
    max_grad_norm: float
    dist: DistContext = field(default_factory=DistContext)
    trainable: list[nn.Parameter] = field(init=False)

    def __post_init__(self):
        self.trainable = [p for p in self.objective.parameters() if p.requires_grad]
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.precision.name == "fp16")

    def _batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True)
                for k, v in collate(rows, self.pad_id).items()}

    def train_step(self, micro_batches: list[list[dict]], *, window_targets: int | None = None,
                   window_tokens: int | None = None,
                   filler: dict | None = None) -> StepResult:
        """One optimizer update from this process's micro-batches.

        The loss is normalised by the target tokens of the whole global batch (all
        micro-batches of all processes), so each token weighs the same wherever it is.
        Without `window_targets`/`window_tokens` this process's micro-batches are the
        whole batch. An empty micro-batch is filler: it runs forward and backward on a
        real row (`filler`, default this process's first row) with weight zero, so every
        process makes the same collective calls.
        """
        start = time.perf_counter()
        self.objective.train()
        local = [row for rows in micro_batches for row in rows]
        if window_targets is None:
            window_targets = sum(row["num_targets"] for row in local)
        if window_tokens is None:
            window_tokens = sum(len(row["input_ids"]) for row in local)
        filler = filler or (local[0] if local else None)
        assert filler is not None, "a process without rows needs a filler row"
        scale = self.dist.world_size / max(window_targets, 1)
        loss_sum = 0.0
        for index, rows in enumerate(micro_batches):
            weight = scale if rows else 0.0
            last = index == len(micro_batches) - 1
            with gradient_sync(self.objective, last):
                with self.precision.autocast(self.device):
                    micro_loss, _ = self.objective(self._batch(rows or [filler]))
                self.scaler.scale(micro_loss * weight).backward()
            if rows:
                loss_sum += micro_loss.item()
        (loss_sum,) = self.dist.all_reduce_sum([loss_sum])
        self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=loss_sum / max(window_targets, 1), grad_norm=grad_norm, lr=lr,
                          target_tokens=window_targets, real_tokens=window_tokens,
                          seconds=time.perf_counter() - start)

    def _clip(self) -> float:
        if self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
            return float(full_value(norm))
        grads = [full_value(p.grad.detach().norm()) for p in self.trainable
                 if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0

    @torch.no_grad()
    def evaluate(self, rows: list[dict], micro_batch_size: int) -> dict[str, float]:
        """Mean CE per target token over all eval rows (split over processes), and its ppl."""
        self.objective.eval()
        total, count = 0.0, 0.0
        for mine in split_for_rank(rows, self.dist.rank, self.dist.world_size, micro_batch_size):
            with self.precision.autocast(self.device):
                loss_sum, n = self.objective(self._batch(mine or rows[:1]))
            if mine:
                total += loss_sum.item()
                count += int(n)
        total, count = self.dist.all_reduce_sum([total, count])
        loss = total / max(count, 1)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


StepCallback = Callable[[int, dict], None]
