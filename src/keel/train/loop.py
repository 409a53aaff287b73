"""The one training loop, shared by every stage.

A step is one optimizer update over an accumulation window of micro-batches; which rows a
step uses is the batch source's business (keel.train.batch_source).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from keel.data import collate
from keel.distributed.context_parallel import shard_tokens
from keel.distributed.parallelize import (
    clip_grad_norm,
    full_value,
    gradient_sync,
    sync_replicated_grads,
    unwrap,
)
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy
from keel.distributed.tensor_parallel import sum_partial_grads
from keel.distributed.watchdog import Progress
from keel.precision import Precision
from keel.stages.base import Objective, ObjectiveOutput
from keel.train.batch_source import split_for_rank
from keel.train.preference import reduce_statistics


@dataclass
class StepResult:
    """One optimizer step, as this process saw it. Tensors stay on the device: reading them
    is a host sync, which the loop does only on logging steps (`reduce_losses`)."""

    loss_sum: torch.Tensor  # [] this process's summed CE over its target tokens (detached)
    grad_norm: torch.Tensor  # [] total gradient norm before clipping (a DTensor under FSDP)
    lr: float
    target_tokens: int  # of the whole global batch (all processes)
    real_tokens: int  # non-padding input tokens of the whole global batch
    rows: int  # rows this process trained on
    filler_micro_batches: int  # zero-weight micro-batches this process ran
    # (sum, count) of each of the objective's statistics over this process's rows (detached),
    # None for objectives without statistics (pt, sft)
    statistics: torch.Tensor | None = None
    window_statistic: float | None = None  # e.g. KTO's reference point, the same on every rank
    # the batch source's numbers for the step's record (a rollout's rewards; see StepBatch)
    source_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ReducedSteps:
    """What the logging step reads of the steps since the last one, the same on every rank."""

    losses: list[float]  # global loss of each step
    grad_norms: list[float]
    statistics: list[list[float]]  # each step's globally summed (sum, count) vector, or []


def grad_scaler(
    device: torch.device, precision: Precision, strategy: Strategy = Strategy.SINGLE
) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling (a disabled scaler, a no-op, for fp32 and bf16).

    Under FSDP each rank checks only its own gradient shards for inf/NaN, so ranks could
    disagree on skipping a step and then on the scale: ShardedGradScaler all-reduces the
    check, and every rank skips the same steps. (DDP's gradients are all-reduced before the
    check, so every rank already sees the same ones.)
    """
    enabled = precision.name == "fp16"
    if enabled and strategy.shards:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, process_group=None)  # None: the default group
    return torch.amp.GradScaler(device.type, enabled=enabled)


def to_device(value, device: torch.device):
    """A batch entry on `device`: a tensor, or a vision batch's images (a list of dicts of
    tensors, keel.data.collate); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [{k: t.to(device, non_blocking=True) for k, t in image.items()} for image in value]
    return value


@dataclass
class Trainer:
    """Runs optimizer steps and evaluations for one objective, on one or many processes.

    `objective` may be wrapped for data parallelism (DDP) or hold sharded parameters
    (FSDP2); both average gradients over processes, which the loss scaling undoes so that
    N processes compute exactly the update one process computes on the same global batch.
    """

    objective: nn.Module  # a stage's Objective (keel.stages.base), maybe in a DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    device: torch.device
    pad_id: int
    max_grad_norm: float
    dist: DistContext = field(default_factory=DistContext)
    progress: Progress = field(default_factory=Progress)  # marks read by the watchdog
    # micro-batches as one row of samples laid end to end (the model runs keel's varlen
    # attention; see keel.models.attention) instead of right-padded rows
    padding_free: bool = False
    strategy: Strategy = Strategy.SINGLE  # fp16: whose overflow checks must agree
    # trainable parameters outside DDP/FSDP (a vision tower kept whole on every rank): their
    # gradients are averaged here, once per step (keel.distributed.parallelize)
    replicated: list[nn.Parameter] = field(default_factory=list)
    # trainable per-head norms under tensor parallelism, whose gradients each process of a
    # group computes from its heads only: summed here, once per step
    tp_partial: list[nn.Parameter] = field(default_factory=list)
    trainable: list[nn.Parameter] = field(init=False)

    def __post_init__(self):
        self.trainable = [p for p in self.objective.parameters() if p.requires_grad]
        self.scaler = grad_scaler(self.device, self.precision, self.strategy)
        self.current_rows: list[dict] = []  # the micro-batch running now (for OOM reports)

    @property
    def inner_objective(self) -> Objective:
        """The stage's objective inside any data-parallel wrapper: what it declares."""
        return unwrap(self.objective)

    def _batch(self, rows: list[dict]) -> dict:
        batch = collate(
            rows,
            self.pad_id,
            padding_free=self.padding_free,
            share_pairs=getattr(self.inner_objective, "shares_pair_prompts", False),
        )
        if not self.padding_free and not any(0 in row["position_ids"][1:] for row in rows):
            # No row holds two samples: plain causal attention is exact (right padding is
            # invisible to real tokens), and without position ids transformers neither
            # builds a mask nor reads a device value back to check for packed rows.
            batch["position_ids"] = None
        if self.dist.cp_size > 1:  # this process's part of the row's tokens
            batch = shard_tokens(
                batch,
                self.dist.cp_rank,
                self.dist.cp_size,
                self.pad_id,
                whole_inputs=self.inner_objective.vision is not None,  # embeds the whole row
            )
            batch["cp_group"] = self.dist.cp_group
        return {k: to_device(v, self.device) for k, v in batch.items()}

    def train_step(
        self,
        micro_batches: list[list[dict]],
        *,
        window_targets: int,
        window_tokens: int,
        filler: dict,
    ) -> StepResult:
        """One optimizer update from this process's micro-batches.

        The loss is normalised by `window_targets`, the target tokens of the whole global
        batch (all micro-batches of all processes), so each token weighs the same wherever
        it is; the caller knows it without communication (every process knows every row's
        size). An empty micro-batch is filler: it runs forward and backward on the real row
        `filler` with weight zero, so every process makes the same collective calls.
        Nothing here reads a device value back to the host (except fp16's overflow check).
        """
        self.objective.train()
        scale = self.dist.grad_size / max(window_targets, 1)  # DDP/FSDP average over dp x cp
        loss_sum = torch.zeros((), device=self.device)
        statistics = None
        mark = self.progress.mark
        window_statistic = self._window_statistic(micro_batches, filler)
        for index, rows in enumerate(micro_batches):
            weight = scale if rows else 0.0
            last = index == len(micro_batches) - 1
            self.current_rows = rows or [filler]
            with gradient_sync(self.objective, last):
                mark(("micro-batch", index, "forward"))
                with self.precision.autocast(self.device):
                    out: ObjectiveOutput = self.objective(self._batch(self.current_rows))
                mark(("micro-batch", index, "backward"))
                self.scaler.scale(out.loss * weight).backward()
            if rows:
                loss_sum += out.loss.detach().float()
                if out.statistics is not None:
                    stats = out.statistics
                    statistics = stats if statistics is None else statistics + stats
        mark("optimizer step")
        sync_replicated_grads(self.replicated, self.dist.dims)
        sum_partial_grads(self.tp_partial, self.dist.tp_group)
        self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        lr = float(self.optimizer.param_groups[0]["lr"])  # a tensor in torchao's optimizers
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss_sum=loss_sum,
            grad_norm=grad_norm,
            lr=lr,
            target_tokens=window_targets,
            real_tokens=window_tokens,
            rows=sum(len(rows) for rows in micro_batches),
            filler_micro_batches=sum(not rows for rows in micro_batches),
            statistics=self._zero_statistics() if statistics is None else statistics,
            window_statistic=window_statistic,
        )

    def _zero_statistics(self) -> torch.Tensor | None:
        """A process whose micro-batches were all filler still sends its (zero) statistics:
        every rank's vector has the same length."""
        names = self.inner_objective.metric_names
        return torch.zeros(2 * len(names), device=self.device) if names else None

    def _window_statistic(self, micro_batches: list[list[dict]], filler: dict) -> float | None:
        """The objective's number over the whole global batch that its losses need first
        (KTO's KL reference point), or None: a no-grad pass over every micro-batch (filler
        too, so all ranks run the same forwards) and one all-reduce of (sum, count)."""
        inner = self.inner_objective
        if not inner.needs_window_statistic:
            return None
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for index, rows in enumerate(micro_batches):
                self.progress.mark(("micro-batch", index, "window statistic"))
                with self.precision.autocast(self.device):
                    value, count = self.objective(self._batch(rows or [filler]), mode="statistic")
                if rows:
                    total += torch.stack([value.double(), count.double()])
        value_sum, count = self.dist.sum_over_rows(total.cpu().tolist())
        mean = value_sum / max(count, 1)
        inner.set_window_statistic(mean)
        return max(0.0, mean)

    def reduce_losses(self, results: list[StepResult]) -> ReducedSteps:
        """Global loss, grad norm and statistics of each step in `results`: one host sync
        and one small collective for all of them. Every process must call it at the same
        steps; every rank sends the same number of values (fixed-layout statistics)."""
        if not results:
            return ReducedSteps([], [], [])
        local = [r.loss_sum.reshape(1) for r in results]  # [1] each
        local += [r.statistics for r in results if r.statistics is not None]
        flat = torch.cat([t.double().cpu() for t in local]).tolist()
        reduced = self.dist.sum_over_rows(flat)
        global_sums, rest = reduced[: len(results)], reduced[len(results) :]
        norms = torch.stack([full_value(r.grad_norm).float() for r in results]).cpu().tolist()
        losses = [s / max(r.target_tokens, 1) for s, r in zip(global_sums, results)]
        statistics = []
        for r in results:
            size = 0 if r.statistics is None else r.statistics.numel()
            statistics.append(rest[:size])
            rest = rest[size:]
        return ReducedSteps(losses, norms, statistics)

    def _clip(self) -> torch.Tensor:
        """The total gradient norm (before clipping), left on the device."""
        if self.replicated or self.dist.tp_size > 1:  # gradients on several meshes
            return clip_grad_norm(self.trainable, self.max_grad_norm)
        if self.max_grad_norm > 0:
            return torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
        grads = [p.grad for p in self.trainable if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(grads)

    @torch.no_grad()
    def evaluate(self, rows: list[dict], micro_batch_size: int) -> dict[str, float]:
        """Mean loss per target token (pt, sft: and its ppl) or per pair/sample (preference,
        with its statistics) over all eval rows, split over processes."""
        self.objective.eval()
        mine = split_for_rank(rows, self.dist.dp_rank, self.dist.dp_size, micro_batch_size)
        self._window_statistic(mine, rows[0])
        total, count, statistics = 0.0, 0.0, self._zero_statistics()
        for batch_rows in mine:
            with self.precision.autocast(self.device):
                out: ObjectiveOutput = self.objective(self._batch(batch_rows or rows[:1]))
            if batch_rows:
                total += out.loss.item()
                count += float(out.count)
                if out.statistics is not None:
                    statistics = statistics + out.statistics
        vector = [] if statistics is None else statistics.double().cpu().tolist()
        total, count, *vector = self.dist.sum_over_rows([total, count, *vector])
        loss = total / max(count, 1)
        result = {"eval_loss": loss}
        if getattr(self.inner_objective, "reports_perplexity", False):  # pt, sft
            result["eval_ppl"] = math.exp(min(loss, 50.0))
        named = reduce_statistics(self.inner_objective.metric_names, vector)
        return result | {f"eval_{k}": v for k, v in named.items()}


StepCallback = Callable[[int, dict], None]
