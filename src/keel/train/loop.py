"""The one training loop, shared by every stage.

A step is one optimizer update over an accumulation window of micro-batches. Which rows a
step uses is a pure function of (step, seed): resuming needs only the step number.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from keel.data import collate, epoch_order
from keel.distributed.parallelize import full_value, gradient_sync, unwrap
from keel.distributed.process_group import DistContext
from keel.distributed.watchdog import Progress
from keel.train.precision import Precision
from keel.train.preference import reduce_statistics


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

    def schedule(self, epochs: float, max_steps: int | None) -> str:
        """How long the run is in steps and epochs, and which key decided it (max_steps
        overrides epochs when set, as in Hugging Face's Trainer and TRL)."""
        total = self.total_steps(epochs, max_steps)
        per_epoch = f"{self.steps_per_epoch} steps/epoch of {self.global_batch} rows"
        if max_steps is None:
            return f"train.epochs={epochs:g}: {total} steps ({per_epoch})"
        spent = round(total / self.steps_per_epoch, 2)
        return (
            f"train.max_steps={max_steps} overrides train.epochs={epochs:g}: {total} steps "
            f"= {spent:g} epochs ({per_epoch})"
        )

    def window(self, step: int) -> list[int]:
        """Row indices of optimizer step `step`'s global batch (0-based step)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        first = index * self.global_batch
        return self._order(epoch)[first : min(first + self.global_batch, self.num_rows)]

    def micro_batches(self, step: int, rank: int = 0, world_size: int = 1) -> list[list[int]]:
        """This process's micro-batches of step `step`; empty lists are filler."""
        return split_for_rank(self.window(step), rank, world_size, self.micro_batch_size)

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    def idle_warning(self, world_size: int) -> str | None:
        """Why some process runs a zero-weight filler micro-batch on every full step, or None.

        Filler keeps the collectives in step on an uneven last window; on every step it is
        a process (a GPU) doing no useful work.
        """
        size = min(self.global_batch, self.num_rows)
        window = list(range(size))
        per_rank = [
            split_for_rank(window, r, world_size, self.micro_batch_size) for r in range(world_size)
        ]
        idle = [r for r, mbs in enumerate(per_rank) if any(not mb for mb in mbs)]
        if not idle:
            return None
        slots = world_size * len(per_rank[0])
        fillers = sum(not mb for mbs in per_rank for mb in mbs)
        unit = world_size * self.micro_batch_size
        better = max(unit, math.ceil(size / unit) * unit)
        return (
            f"{len(idle)} of {world_size} processes run zero-weight filler micro-batches "
            f"on every step ({fillers} of {slots} micro-batches per step do no work): a "
            f"global batch of {size} rows over {world_size} processes x micro_batch_size "
            f"{self.micro_batch_size}. Use a multiple of {unit} rows (e.g. "
            f"train.global_batch_size={better}), or leave train.global_batch_size unset "
            f"(then it is micro_batch_size x grad_accum x processes), or fewer processes"
        )

    @lru_cache(maxsize=2)  # noqa: B019 - the plan is immutable and lives as long as the run
    def _order(self, epoch: int) -> list[int]:
        return epoch_order(self.num_rows, epoch, self.seed, self.shuffle)


def default_global_batch(micro_batch_size: int, grad_accum: int, world_size: int) -> int:
    """Rows per optimizer step when train.global_batch_size is unset: micro_batch_size is
    per process, as in every other trainer, so more processes mean a larger batch."""
    return micro_batch_size * grad_accum * world_size


def split_for_rank(rows: list, rank: int, world_size: int, micro_batch_size: int) -> list[list]:
    """Rank `rank`'s micro-batches of `rows`; the same count on every rank (padded with [])."""
    mine = rows[rank::world_size]
    count = max(1, math.ceil(math.ceil(len(rows) / world_size) / micro_batch_size))
    return [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count)]


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


@dataclass
class ReducedSteps:
    """What the logging step reads of the steps since the last one, the same on every rank."""

    losses: list[float]  # global loss of each step
    grad_norms: list[float]
    statistics: list[list[float]]  # each step's globally summed (sum, count) vector, or []


def grad_scaler(
    device: torch.device, precision: Precision, strategy: str = "none"
) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling (a disabled scaler, a no-op, for fp32 and bf16).

    Under FSDP each rank checks only its own gradient shards for inf/NaN, so ranks could
    disagree on skipping a step and then on the scale: ShardedGradScaler all-reduces the
    check, and every rank skips the same steps. (DDP's gradients are all-reduced before the
    check, so every rank already sees the same ones.)
    """
    enabled = precision.name == "fp16"
    if enabled and strategy == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, process_group=None)  # None: the default group
    return torch.amp.GradScaler(device.type, enabled=enabled)


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
    progress: Progress = field(default_factory=Progress)  # marks read by the watchdog
    # micro-batches as one row of samples laid end to end (the model runs keel's varlen
    # attention; see keel.models.attention) instead of right-padded rows
    padding_free: bool = False
    strategy: str = "none"  # none | ddp | fsdp (fp16: whose overflow checks must agree)
    trainable: list[nn.Parameter] = field(init=False)

    def __post_init__(self):
        self.trainable = [p for p in self.objective.parameters() if p.requires_grad]
        self.scaler = grad_scaler(self.device, self.precision, self.strategy)
        self.current_rows: list[dict] = []  # the micro-batch running now (for OOM reports)

    def _batch(self, rows: list[dict]) -> dict:
        batch = collate(rows, self.pad_id, padding_free=self.padding_free)
        if not self.padding_free and not any(0 in row["position_ids"][1:] for row in rows):
            # No row holds two samples: plain causal attention is exact (right padding is
            # invisible to real tokens), and without position ids transformers neither
            # builds a mask nor reads a device value back to check for packed rows.
            batch["position_ids"] = None
        return {
            k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }

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
        scale = self.dist.world_size / max(window_targets, 1)
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
                    micro_loss, _, *extra = self.objective(self._batch(self.current_rows))
                mark(("micro-batch", index, "backward"))
                self.scaler.scale(micro_loss * weight).backward()
            if rows:
                loss_sum += micro_loss.detach().float()
                if extra:
                    statistics = extra[0] if statistics is None else statistics + extra[0]
        mark("optimizer step")
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
        names = getattr(unwrap(self.objective), "metric_names", ())
        return torch.zeros(2 * len(names), device=self.device) if names else None

    def _window_statistic(self, micro_batches: list[list[dict]], filler: dict) -> float | None:
        """The objective's number over the whole global batch that its losses need first
        (KTO's KL reference point), or None: a no-grad pass over every micro-batch (filler
        too, so all ranks run the same forwards) and one all-reduce of (sum, count)."""
        inner = unwrap(self.objective)
        if not getattr(inner, "needs_window_statistic", False):
            return None
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for index, rows in enumerate(micro_batches):
                self.progress.mark(("micro-batch", index, "window statistic"))
                with self.precision.autocast(self.device):
                    value, count = self.objective(self._batch(rows or [filler]), mode="statistic")
                if rows:
                    total += torch.stack([value.double(), count.double()])
        value_sum, count = self.dist.all_reduce_sum(total.cpu().tolist())
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
        reduced = self.dist.all_reduce_sum(flat)
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
        mine = split_for_rank(rows, self.dist.rank, self.dist.world_size, micro_batch_size)
        self._window_statistic(mine, rows[0])
        total, count, statistics = 0.0, 0.0, self._zero_statistics()
        for batch_rows in mine:
            with self.precision.autocast(self.device):
                loss_sum, n, *extra = self.objective(self._batch(batch_rows or rows[:1]))
            if batch_rows:
                total += loss_sum.item()
                count += int(n)
                if extra:
                    statistics = statistics + extra[0]
        vector = [] if statistics is None else statistics.double().cpu().tolist()
        total, count, *vector = self.dist.all_reduce_sum([total, count, *vector])
        loss = total / max(count, 1)
        names = getattr(unwrap(self.objective), "metric_names", ())
        if not names:
            return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        named = reduce_statistics(names, vector)
        return {"eval_loss": loss, **{f"eval_{k}": v for k, v in named.items()}}


StepCallback = Callable[[int, dict], None]
