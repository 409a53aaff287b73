"""The training loop of one run (every process): the steps, logging, evaluation, periodic
checkpoints, and the stops (divergence, preemption, out of memory).

`keel.train.run` sets the run up (preflight, model, data, optimizer, resume) and hands it
to `TrainingLoop.run`; this module only runs the steps it was given.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc
import torch

from keel import __version__
from keel.config import RunConfig, config_to_dict
from keel.config.schema import PREFERENCE_STAGES
from keel.data import PreparedData
from keel.distributed.parallelize import unwrap
from keel.distributed.process_group import DistContext
from keel.distributed.watchdog import Watchdog
from keel.faults import Fault, at_step_start
from keel.train import checkpoint as ckpt
from keel.train.loop import ReducedSteps, StepCallback, StepPlan, StepResult, Trainer
from keel.train.metrics import MetricsLog, Progress, memory_now
from keel.train.optim import scheduler_state
from keel.train.preference import reduce_statistics
from keel.train.reference import ReferenceLogps
from keel.train.stops import Preemption, check_finite
from keel.train.watch import HostOutOfMemory, out_of_memory


@dataclass
class RunEnv:
    """Who runs the training and what watches it (one per process)."""

    dist: DistContext
    log: Callable[[str], None]
    detail: Callable[[str], None]  # technical lines: `log` with --verbose, else dropped
    on_step_end: StepCallback | None
    watchdog: Watchdog
    fault: Fault | None
    preemption: Preemption
    memory_advice: list[str] = field(default_factory=list)  # the plan's lighter options

    def phase(self, name: str, limit: float | None):
        return self.watchdog.progress.phase(name, limit)


class TrainingLoop:
    """Steps, logging, evaluation and periodic checkpoints for one run (every process)."""

    def __init__(
        self,
        cfg: RunConfig,
        out: Path,
        trainer: Trainer,
        plan: StepPlan,
        data: PreparedData,
        env: RunEnv,
        references: dict[str, ReferenceLogps] | None = None,
    ):
        self.cfg, self.out, self.trainer, self.plan, self.data = cfg, out, trainer, plan, data
        self.reference_logps = references["train"] if references else None
        self.env, self.dist, self.log, self.on_step_end = env, env.dist, env.log, env.on_step_end
        # Every process knows every row's size, so the global batch's target count needs
        # no communication.
        table = data.train.with_format("arrow")
        self.row_targets = table["num_targets"].to_pylist()
        self.row_tokens = pc.list_value_length(table["input_ids"]).to_pylist()
        # Materialised once: the eval split does not change during a run.
        self.eval_rows = [data.eval[i] for i in range(len(data.eval))] if data.eval else []
        if references and self.eval_rows:
            for index, row in enumerate(self.eval_rows):
                row.update(references["eval"].row(index))

    def run(self, start: int, total: int, meta: dict) -> tuple[list[float], dict]:
        out_cfg = self.cfg.output
        main = self.dist.is_main
        metrics = (
            MetricsLog(
                self.out,
                resume_step=start,
                output=out_cfg,
                run_config=config_to_dict(self.cfg),
                log=self.log,
            )
            if main
            else None
        )
        bar = Progress(total=total, initial=start, enabled=main, log=self.log)
        progress = self.env.watchdog.progress
        losses: list[float] = []
        stats = {
            "real_tokens": 0,
            "target_tokens": 0,
            "train_seconds": 0.0,
            "loss": None,
            "rows": 0,
            "filler_micro_batches": 0,
        }
        pending: list[StepResult] = []  # steps whose losses have not been read yet
        window = {"real": 0, "seconds": 0.0}  # since the last logged step
        try:
            for step in range(start, total):
                began = time.perf_counter()
                done = step + 1
                logged = done % out_cfg.log_every == 0 or done == total
                saving = bool(out_cfg.save_every and done % out_cfg.save_every == 0)
                saving = saving or done == total
                synced = logged or saving  # no checkpoint unread: it may hold a NaN step
                with self.env.phase("step", self.cfg.watchdog.hang_timeout_s):
                    progress.step_begin(done)
                    result = self._step(step)
                    pending.append(result)
                    if synced:  # the loop's only host sync: every loss since the last one
                        first = done - len(pending) + 1
                        reduced = self.trainer.reduce_losses(pending)
                        losses += reduced.losses
                        pending = []
                    seconds = time.perf_counter() - began
                    progress.step_end(seconds)
                for key, value in (
                    ("real_tokens", result.real_tokens),
                    ("target_tokens", result.target_tokens),
                    ("train_seconds", seconds),
                    ("rows", result.rows),
                    ("filler_micro_batches", result.filler_micro_batches),
                ):
                    stats[key] += value
                window["real"] += result.real_tokens
                window["seconds"] += seconds
                tokens_per_s = window["real"] / max(window["seconds"], 1e-9)
                record = None
                if logged:
                    stats["loss"] = reduced.losses[-1]
                    record = {
                        "step": done,
                        "epoch": round(self.plan.epoch_of(done), 4),
                        "loss": reduced.losses[-1],
                        **self._statistics(result, reduced),
                        "lr": result.lr,
                        "grad_norm": reduced.grad_norms[-1],
                        "tokens_per_s": tokens_per_s,
                        # the logging window's (real tokens, seconds): steps since the last
                        # logged one, so benchmarks can leave out the warm-up step
                        "real_tokens": window["real"],
                        "step_seconds": round(window["seconds"], 4),
                        "target_tokens": result.target_tokens,
                        **memory_now(),
                    }
                    if self.cfg.train.stage in PREFERENCE_STAGES:  # its "targets" are pairs
                        del record["target_tokens"]
                    window = {"real": 0, "seconds": 0.0}
                    if metrics is not None:
                        metrics.write(record)  # before stopping: it shows the bad value
                if synced:
                    self._check_finite(reduced, first)
                bar.update(record and record["loss"], result.lr, tokens_per_s)
                self._maybe_eval(done, total, metrics, bar)
                if saving:
                    self._save(done, meta)
                if self.on_step_end is not None:
                    self.on_step_end(done, record or {"step": done})
                if done < total and self._preempted():
                    self._stop(done, meta, pending, saved=saving)
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
        return losses, stats

    def _check_finite(self, reduced: ReducedSteps, first: int) -> None:
        """Diverged at a non-finite loss or grad norm, except under fp16's loss scaler,
        which skips such steps (their update is never applied) by design."""
        if self.trainer.scaler.is_enabled():
            return
        check_finite(reduced.losses, reduced.grad_norms, first, self._newest_checkpoint)

    def _newest_checkpoint(self) -> Path | None:
        found = ckpt.complete_checkpoints(self.out)
        return found[-1] if found else None

    def _preempted(self) -> bool:
        """Whether any rank got a preemption signal: asked by every rank after every step
        (one number over the CPU backend, no device sync: 1.6 ms with 2 gloo processes, 3.2 ms
        through the collective cross-check, on a 2-core machine at load 13), so that all of
        them stop after the same step and none waits alone in a collective."""
        with self.env.phase("preemption check", self.cfg.watchdog.hang_timeout_s):
            return self.env.preemption.agreed(self.dist)

    def _stop(self, done: int, meta: dict, pending: list[StepResult], *, saved: bool):
        """Save step `done` (once: unless this step already saved) and raise Preempted.
        Steps not yet read back are checked first: a diverged state is never saved."""
        if pending:
            first = done - len(pending) + 1
            with self.env.phase("step", self.cfg.watchdog.hang_timeout_s):
                self._check_finite(self.trainer.reduce_losses(pending), first)
        if not saved:
            self._save(done, meta)
        newest = ckpt.complete_checkpoints(self.out)
        where = newest[-1] if newest else self.out / "checkpoints"
        raise self.env.preemption.stopped(done, str(where))

    def _statistics(self, result: StepResult, reduced: ReducedSteps) -> dict[str, float]:
        """A preference step's named statistics (TRL's names), or nothing for pt/sft."""
        names = getattr(unwrap(self.trainer.objective), "metric_names", ())
        if not names:
            return {}
        named = reduce_statistics(names, reduced.statistics[-1])
        if result.window_statistic is not None:
            named["kl"] = result.window_statistic
        named["pairs" if self.cfg.train.stage != "kto" else "samples"] = result.target_tokens
        return named

    def _row(self, index: int) -> dict:
        row = self.data.train[index]
        if self.reference_logps is not None:
            row.update(self.reference_logps.row(index))
        return row

    def _step(self, step: int) -> StepResult:
        window = self.plan.window(step)
        micro = self.plan.micro_batches(step, self.dist.rank, self.dist.world_size)
        rows = [[self._row(i) for i in mb] for mb in micro]
        at_step_start(self.env.fault, step + 1, self.dist.rank)
        try:
            return self.trainer.train_step(
                rows,
                window_targets=sum(self.row_targets[i] for i in window),
                window_tokens=sum(self.row_tokens[i] for i in window),
                filler=self._row(window[0]),
            )
        except (torch.OutOfMemoryError, HostOutOfMemory) as exc:
            newest = ckpt.complete_checkpoints(self.out)
            raise out_of_memory(
                exc,
                step=step + 1,
                rank=self.dist.rank,
                rows=self.trainer.current_rows,
                cfg=self.cfg,
                checkpoint=newest[-1] if newest else None,
                lighter=self.env.memory_advice,
            ) from None

    def _maybe_eval(self, done: int, total: int, metrics: MetricsLog | None, progress: Progress):
        if not self.eval_rows:
            return
        every = self.cfg.train.eval_every
        if (every and done % every == 0) or done == total:
            with self.env.phase("eval", self.cfg.watchdog.hang_timeout_s):
                result = self.trainer.evaluate(self.eval_rows, self.cfg.train.micro_batch_size)
            if metrics is not None:
                metrics.write({"step": done, **result})
            shown = f"step {done}: eval_loss {result['eval_loss']:.4f}"
            if "eval_ppl" in result:
                shown += f" ppl {result['eval_ppl']:.2f}"
            if "eval_rewards/accuracies" in result:
                shown += f" reward accuracy {result['eval_rewards/accuracies']:.2f}"
            progress.write(shown)

    def _save(self, step: int, meta: dict) -> None:
        with self.env.phase("checkpoint save", self.cfg.watchdog.slow_phase_timeout_s):
            self._save_now(step, meta)

    def _save_now(self, step: int, meta: dict) -> None:
        ckpt.save_checkpoint(
            self.out,
            step,
            module=self.trainer.objective,
            optimizer=self.trainer.optimizer,
            scheduler=scheduler_state(self.trainer.scheduler),
            scaler=self.trainer.scaler.state_dict(),
            meta={**meta, "keel_version": __version__, "world_size": self.dist.world_size},
            keep_last=self.cfg.output.keep_last,
            dist=self.dist,
        )
