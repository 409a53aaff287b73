"""Where a step's rows come from: the loop asks a `BatchSource` for step N's work on this
process, and the checkpoint holds the source's state.

`DatasetBatchSource` is the fixed, pre-tokenised dataset, whose order is a pure function of
(step, seed) (`StepPlan`). A source that makes its rows each step (online RL's rollouts)
implements the same protocol, and its state_dict carries what resuming it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow.compute as pc

from keel.data import epoch_order
from keel.errors import CheckpointError

if TYPE_CHECKING:
    from datasets import Dataset

    from keel.config import RunConfig
    from keel.config.schema import TrainConfig
    from keel.data import PreparedData
    from keel.data.stream import RowStream
    from keel.train.reference import ReferenceLogps

BATCH_SOURCE = "batch_source"  # the source's name among the checkpoint's parts


@dataclass(frozen=True)
class StepPlan:
    """Maps optimizer steps to rows, and each process's share to micro-batches.

    A step's global batch is `global_batch` consecutive rows of the epoch's order, whatever
    the number of processes; windows never cross epochs. Process r takes every world-th row
    of it, and every process runs the same number of micro-batches: a process with fewer
    rows gets empty micro-batches, which the trainer runs as zero-weight filler so that all
    processes make the same collective calls (uneven remainders never hang a run).
    """

    num_rows: int | None  # None: streamed data (keel.data.stream), of unknown length
    global_batch: int
    micro_batch_size: int
    seed: int
    shuffle: bool

    @classmethod
    def of(cls, cfg: RunConfig, num_rows: int | None, global_batch: int) -> StepPlan:
        """The order `cfg` asks for (its micro-batch size, seed and shuffle) over `num_rows`
        rows in global batches of `global_batch`."""
        return cls(
            num_rows=num_rows,
            global_batch=global_batch,
            micro_batch_size=cfg.train.micro_batch_size,
            seed=cfg.train.seed,
            shuffle=cfg.data.shuffle,
        )

    @property
    def steps_per_epoch(self) -> int | None:
        """None for streamed data (data.streaming needs train.max_steps)."""
        return None if self.num_rows is None else math.ceil(self.num_rows / self.global_batch)

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        return max(1, math.ceil(epochs * self.steps_per_epoch))

    def schedule(self, epochs: float, max_steps: int | None) -> str:
        """How long the run is in steps and epochs, and which key decided it (max_steps
        overrides epochs when set, as in Hugging Face's Trainer and TRL)."""
        total = self.total_steps(epochs, max_steps)
        if self.num_rows is None:
            return (
                f"train.max_steps={total}: {total} steps of {self.global_batch} row(s), "
                f"streamed (as many epochs as that takes)"
            )
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

    def micro_batches(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> list[list[int]]:
        """Data-parallel rank `dp_rank`'s micro-batches of step `step`; empty lists are filler."""
        return split_for_rank(self.window(step), dp_rank, dp_size, self.micro_batch_size)

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    def describe(
        self, train: TrainConfig, dp_size: int, total: int, start: int, cp: int = 1, tp: int = 1
    ) -> list[str]:
        """The log lines of a run of `total` steps from step `start`: its length, how a
        step's batch is split over `dp_size` processes (groups of `cp` processes that split
        each micro-batch's tokens, under context parallelism, or of `tp` that split each
        layer, under tensor parallelism), and whether a process idles."""
        per_process = math.ceil(self.global_batch / dp_size)
        rows = "streamed rows" if self.num_rows is None else f"{self.num_rows} rows"
        per_epoch = "" if self.num_rows is None else f"{self.steps_per_epoch} steps/epoch, "
        who, each = f"{dp_size} process(es)", "process"
        for size, kind in ((cp, "context"), (tp, "tensor")):
            if size > 1:
                who, each = f"{dp_size} group(s) of {size} processes ({kind} parallel)", "group"
        lines = [
            f"steps: {self.schedule(train.epochs, train.max_steps)}",
            f"training: {rows}, global batch {self.global_batch} rows over {who} "
            f"(~{per_process} per {each}, micro-batches of {train.micro_batch_size}), "
            f"{per_epoch}{total} steps, starting at step {start}",
        ]
        idle = self.idle_warning(dp_size)
        return lines + ([f"warning: {idle}"] if idle else [])

    def idle_warning(self, dp_size: int) -> str | None:
        """Why some process runs a zero-weight filler micro-batch on every full step, or None.

        Filler keeps the collectives in step on an uneven last window; on every step it is
        a process (a GPU) doing no useful work.
        """
        size = min(self.global_batch, self.num_rows or self.global_batch)
        window = list(range(size))
        per_rank = [
            split_for_rank(window, r, dp_size, self.micro_batch_size) for r in range(dp_size)
        ]
        idle = [r for r, mbs in enumerate(per_rank) if any(not mb for mb in mbs)]
        if not idle:
            return None
        slots = dp_size * len(per_rank[0])
        fillers = sum(not mb for mbs in per_rank for mb in mbs)
        unit = dp_size * self.micro_batch_size
        better = max(unit, math.ceil(size / unit) * unit)
        return (
            f"{len(idle)} of {dp_size} processes run zero-weight filler micro-batches "
            f"on every step ({fillers} of {slots} micro-batches per step do no work): a "
            f"global batch of {size} rows over {dp_size} processes x micro_batch_size "
            f"{self.micro_batch_size}. Use a multiple of {unit} rows (e.g. "
            f"train.global_batch_size={better}), or leave train.global_batch_size unset "
            f"(then it is micro_batch_size x grad_accum x processes), or fewer processes"
        )

    @lru_cache(maxsize=2)  # noqa: B019 - the plan is immutable and lives as long as the run
    def _order(self, epoch: int) -> list[int]:
        return epoch_order(self.num_rows, epoch, self.seed, self.shuffle)


def default_global_batch(micro_batch_size: int, grad_accum: int, dp_size: int) -> int:
    """Rows per optimizer step when train.global_batch_size is unset: micro_batch_size is
    per data-parallel process, as in every other trainer, so more processes mean a larger
    batch."""
    return micro_batch_size * grad_accum * dp_size


def split_for_rank(rows: list, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[list]:
    """Data-parallel rank `dp_rank`'s micro-batches of `rows`; the same count on every rank
    (padded with [])."""
    mine = rows[dp_rank::dp_size]
    count = max(1, math.ceil(math.ceil(len(rows) / dp_size) / micro_batch_size))
    return [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count)]


@dataclass(kw_only=True)
class StepBatch:
    """One optimizer step's work for this process (see `Trainer.train_step`)."""

    micro_batches: list[list[dict]]  # this process's rows; [] is a zero-weight filler
    # of the whole global batch (every process): the loss is normalised by window_targets
    window_targets: int
    window_tokens: int  # non-padding input tokens
    filler: dict  # the real row a filler micro-batch runs on (with weight zero)
    rows: int  # rows in the whole global batch
    # the source's own numbers for the step's record (a rollout's rewards), the same on
    # every rank
    metrics: dict[str, float] = field(default_factory=dict)


class BatchSource(Protocol):
    """Gives each optimizer step its rows, on this process."""

    def batch(self, step: int) -> StepBatch:
        """Step `step`'s (0-based) rows on this process: every process calls it for the
        same steps, and gets the same number of micro-batches."""
        ...

    def epoch_of(self, step: int) -> float:
        """Epochs done after `step` steps (for the logs)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class DatasetBatchSource:
    """The prepared training split in `plan`'s order, split for data-parallel rank
    `dp_rank` of `dp_size`, each row with its precomputed reference log-probs (if any)."""

    def __init__(
        self,
        plan: StepPlan,
        rows: Dataset,
        *,
        dp_rank: int,
        dp_size: int,
        reference: ReferenceLogps | None = None,
    ):
        assert len(rows) == plan.num_rows, "the plan is of another dataset"
        self.plan, self.rows, self.reference = plan, rows, reference
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # Every process knows every row's size, so the global batch's target count needs
        # no communication.
        table = rows.with_format("arrow")
        self.row_targets = table["num_targets"].to_pylist()
        self.row_tokens = pc.list_value_length(table["input_ids"]).to_pylist()

    def batch(self, step: int) -> StepBatch:
        window = self.plan.window(step)
        micro = self.plan.micro_batches(step, self.dp_rank, self.dp_size)
        return StepBatch(
            micro_batches=[[self._row(i) for i in mb] for mb in micro],
            window_targets=sum(self.row_targets[i] for i in window),
            window_tokens=sum(self.row_tokens[i] for i in window),
            filler=self._row(window[0]),
            rows=len(window),
        )

    def epoch_of(self, step: int) -> float:
        return self.plan.epoch_of(step)

    def _row(self, index: int) -> dict:
        row = self.rows[index]
        if self.reference is not None:
            row.update(self.reference.row(index))
        return row

    def state_dict(self) -> dict[str, Any]:
        """What decides the order of rows. The step itself is the position, so this does not
        change during a run; it is saved to refuse resuming into another order."""
        plan = self.plan
        return {
            "kind": "dataset",
            "num_rows": plan.num_rows,
            "global_batch": plan.global_batch,
            "seed": plan.seed,
            "shuffle": plan.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept a checkpoint's state only if it names this order. The run identity already
        refuses each change by its config key (train.seed, data.shuffle, the data fingerprint;
        the global batch is the checkpoint's), so this is a cheap second guard: the source
        vouches for its own order, as a source the identity does not cover must."""
        mine = self.state_dict()
        differences = [
            f"{key} was {state_dict.get(key)!r} in the checkpoint, this run has {value!r}"
            for key, value in mine.items()
            if state_dict.get(key) != value
        ]
        if differences:
            raise CheckpointError(
                f"the checkpoint's data order is not this run's ({'; '.join(differences)}): "
                f"resuming would train on other rows than the saved run would have; set "
                f"train.resume=never to start over, or resume with the checkpoint's settings"
            )


class StreamBatchSource:
    """Streamed rows (keel.data.stream): step N takes the stream's next `global_batch` rows.

    Every process reads the whole stream and takes data-parallel rank `dp_rank`'s share of
    each step's rows, as `DatasetBatchSource` does from prepared rows; so the steps are
    taken in order, and the state is the stream's position after the last one."""

    def __init__(self, stream: RowStream, plan: StepPlan, *, dp_rank: int, dp_size: int):
        self.stream, self.plan = stream, plan
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.next_step = 0

    def batch(self, step: int) -> StepBatch:
        if step != self.next_step:
            raise CheckpointError(
                f"step {step + 1} asks for the streamed data's rows after step {step}, and the "
                f"stream stands after step {self.next_step}: the checkpoint holds no position "
                f"in the streamed data; set train.resume=never to start over"
            )
        window = self.stream.take(self.plan.global_batch)
        rows = list(range(len(window)))
        micro = split_for_rank(rows, self.dp_rank, self.dp_size, self.plan.micro_batch_size)
        self.next_step += 1
        return StepBatch(
            micro_batches=[[window[i] for i in mb] for mb in micro],
            window_targets=sum(row["num_targets"] for row in window),
            window_tokens=sum(len(row["input_ids"]) for row in window),
            filler=window[0],
            rows=len(window),
        )

    def epoch_of(self, step: int) -> float:
        return self.stream.progress()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "step": self.next_step, "cursor": self.stream.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("kind") != "stream":
            raise CheckpointError(
                "the checkpoint's run read prepared data, and this one streams it "
                "(data.streaming): resume with the checkpoint's settings, or set "
                "train.resume=never to start over"
            )
        self.next_step = state_dict["step"]
        self.stream.seek_state(state_dict["cursor"])


def eval_rows(data: PreparedData, references: dict[str, ReferenceLogps] | None) -> list[dict]:
    """The eval split materialised once (it does not change during a run), each row with its
    reference log-probs when they were precomputed; [] without an eval split."""
    if data.eval is None:
        return []
    rows = [data.eval[i] for i in range(len(data.eval))]
    if references and rows:
        for index, row in enumerate(rows):
            row.update(references["eval"].row(index))
    return rows
