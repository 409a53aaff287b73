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

import torch

from keel import __version__
from keel.checkpoint.checkpointer import Checkpointer
from keel.checkpoint.layout import step_dir_name
from keel.config import RunConfig, config_to_dict
from keel.config.schema import QatConfig
from keel.distributed.process_group import DistContext
from keel.distributed.watchdog import Watchdog
from keel.faults import Fault, at_step_start
from keel.quant.qat import set_fake_quantization
from keel.stages.registry import get_stage
from keel.train.batch_source import BatchSource
from keel.train.early_stop import EARLY_STOPPING, EarlyStopping
from keel.train.loop import ReducedSteps, StepCallback, StepResult, Trainer
from keel.train.metrics import MetricsLog, Progress, RunStats, memory_now
from keel.train.preference import reduce_statistics
from keel.train.stops import Preemption, SkippedSteps, check_finite
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


@dataclass
class _LogWindow:
    """The steps since the last logged one: their real tokens and seconds."""

    real_tokens: int = 0
    seconds: float = 0.0

    def add(self, real_tokens: int, seconds: float) -> None:
        self.real_tokens += real_tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / max(self.seconds, 1e-9)


@dataclass(kw_only=True)
class _RunState:
    """What `TrainingLoop.run` carries from step to step."""

    total: int  # the run's last step (1-based)
    meta: dict  # what identifies the run, for each save
    metrics: MetricsLog | None  # rank 0 only
    bar: Progress
    losses: list[float] = field(default_factory=list)  # of the steps read back so far
    stats: RunStats = field(default_factory=RunStats)
    pending: list[StepResult] = field(default_factory=list)  # steps whose losses are unread
    window: _LogWindow = field(default_factory=_LogWindow)
    stopped_at: int | None = None  # early stopping ended the run after this step


@dataclass(kw_only=True)
class _StepRun:
    """One step as the loop saw it."""

    result: StepResult
    seconds: float
    reduced: ReducedSteps | None  # the losses since the last sync, on a synced step
    first: int  # the first of those steps (1-based)


class TrainingLoop:
    """Steps, logging, evaluation and periodic checkpoints for one run (every process)."""

    def __init__(
        self,
        cfg: RunConfig,
        trainer: Trainer,
        env: RunEnv,
        *,
        source: BatchSource,
        checkpointer: Checkpointer,
        eval_rows: list[dict],
    ):
        self.cfg, self.trainer, self.source, self.eval_rows = cfg, trainer, source, eval_rows
        # holds the trainer's stateful parts (and the source's); saves into the run's folder
        self.checkpointer = checkpointer
        self.out = checkpointer.output_dir  # metrics.jsonl lives next to checkpoints/
        self.env, self.dist, self.log, self.on_step_end = env, env.dist, env.log, env.on_step_end
        self.skipped = SkippedSteps()  # fp16: the loss scaler's skipped steps in a row
        self.early_stop: EarlyStopping | None = checkpointer.parts.extras.get(EARLY_STOPPING)
        self.rounding: bool | None = None  # method.qat: the fake quantization is on

    def run(self, start: int, total: int, meta: dict) -> tuple[list[float], RunStats]:
        """Train steps `start`..`total` - 1 (0-based); returns each step's loss (read back on
        logging and saving steps) and what the steps added up to."""
        main = self.dist.is_main
        state = _RunState(
            total=total,
            meta=meta,
            metrics=self._metrics_log(start) if main else None,
            bar=Progress(total=total, initial=start, enabled=main, log=self.log),
        )
        if self.early_stop is not None:  # a resumed run's best checkpoint stays too
            self.checkpointer.keep_step = self.early_stop.best_step
        try:
            for step in range(start, total):
                self._run_step(step, state)
                if state.stopped_at is not None:
                    break
        finally:
            state.bar.close()
            if state.metrics is not None:
                state.metrics.close()
        state.stats.steps = state.stopped_at or total
        if self.early_stop is not None:
            self._keep_best(state.stats.steps)
        return state.losses, state.stats

    def _metrics_log(self, start: int) -> MetricsLog:
        return MetricsLog(
            self.out,
            resume_step=start,
            output=self.cfg.output,
            run_config=config_to_dict(self.cfg),
            log=self.log,
        )

    def _run_step(self, step: int, state: _RunState) -> None:
        """Step `step` and what follows it: the log record, the divergence check, evaluation,
        the save, the step callback and the preemption check."""
        done, out_cfg = step + 1, self.cfg.output
        logged = done % out_cfg.log_every == 0 or done == state.total
        saving = bool(out_cfg.save_every and done % out_cfg.save_every == 0)
        saving = saving or done == state.total
        # early stopping may save at an evaluation: read the losses back there too
        judged = self.early_stop is not None and self._evaluates(done, state.total)
        synced = logged or saving or judged  # no checkpoint unread: it may hold a NaN step
        ran = self._timed_step(step, state, synced=synced)
        state.stats.add_step(ran.result, ran.seconds)
        state.window.add(ran.result.real_tokens, ran.seconds)
        tokens_per_s = state.window.tokens_per_s
        record = self._log_record(done, ran, state) if logged else None
        if ran.reduced is not None:
            self._check_finite(ran.reduced, ran.first)
        state.bar.update(record and record["loss"], ran.result.lr, tokens_per_s)
        evaluated = self._maybe_eval(done, state.total, state.metrics, state.bar)
        verdict = None
        if judged and evaluated is not None:
            verdict = self.early_stop.update(done, evaluated["eval_loss"])
            if verdict.improved:  # the best model so far: a checkpoint to come back to
                self.checkpointer.keep_step, saving = done, True
        if saving:
            self._save(done, state.meta)
        if self.on_step_end is not None:
            self.on_step_end(done, record or {"step": done})
        if verdict is not None and verdict.stop and done < state.total:
            self.log(self.early_stop.why(done))
            state.stopped_at = done
        elif done < state.total and self._preempted():
            self._stop(done, state.meta, state.pending, saved=saving)

    def _timed_step(self, step: int, state: _RunState, *, synced: bool) -> _StepRun:
        """Run step `step` in the watchdog's step phase; when `synced`, read back every step's
        loss since the last sync (the loop's only host sync)."""
        began = time.perf_counter()
        done, progress = step + 1, self.env.watchdog.progress
        reduced, first = None, 0
        with self.env.phase("step", self.cfg.watchdog.hang_timeout_s):
            progress.step_begin(done)
            result = self._step(step)
            state.pending.append(result)
            if synced:
                first = done - len(state.pending) + 1
                reduced = self.trainer.reduce_losses(state.pending)
                state.losses += reduced.losses
                state.pending = []
            seconds = time.perf_counter() - began
            progress.step_end(seconds)
        return _StepRun(result=result, seconds=seconds, reduced=reduced, first=first)

    def _log_record(self, done: int, ran: _StepRun, state: _RunState) -> dict:
        """The logged step's record, written to the metrics (before any stop: it shows the
        bad value); starts the next logging window."""
        reduced, result, window = ran.reduced, ran.result, state.window
        state.stats.final_loss = reduced.losses[-1]
        record = {
            "step": done,
            "epoch": round(self.source.epoch_of(done), 4),
            "loss": reduced.losses[-1],
            **self._statistics(result, reduced),
            "lr": result.lr,
            "grad_norm": reduced.grad_norms[-1],
            "tokens_per_s": window.tokens_per_s,
            # the logging window's (real tokens, seconds): steps since the last logged one,
            # so benchmarks can leave out the warm-up step
            "real_tokens": window.real_tokens,
            "step_seconds": round(window.seconds, 4),
            "target_tokens": result.target_tokens,
            **_source_metrics(result, ran.seconds),
            **memory_now(),
        }
        if get_stage(self.cfg.train.stage).counted != "target_tokens":
            # its count is of pairs or samples, logged under their own name
            del record["target_tokens"]
        state.window = _LogWindow()
        if state.metrics is not None:
            state.metrics.write(record)
        return record

    def _check_finite(self, reduced: ReducedSteps, first: int) -> None:
        """Diverged at a non-finite loss or grad norm; under fp16's loss scaler, which skips
        such steps (their update is never applied) by design, once it has skipped steps in a
        row until its scale fell below MIN_LOSS_SCALE."""
        scaler = self.trainer.scaler
        if not scaler.is_enabled():
            check_finite(reduced.losses, reduced.grad_norms, first, self._newest_checkpoint)
            return
        self.skipped.add(reduced.losses, reduced.grad_norms, first)
        last = first + len(reduced.losses) - 1
        self.skipped.check(last, scaler.get_scale(), self._newest_checkpoint)

    def _newest_checkpoint(self) -> Path | None:
        return self.checkpointer.newest()

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
        where = self.checkpointer.newest() or self.checkpointer.root
        raise self.env.preemption.stopped(done, str(where))

    def _statistics(self, result: StepResult, reduced: ReducedSteps) -> dict[str, float]:
        """A preference step's named statistics (TRL's names), or nothing for pt/sft."""
        names = self.trainer.inner_objective.metric_names
        if not names:
            return {}
        named = reduce_statistics(names, reduced.statistics[-1])
        if result.window_statistic is not None:
            named["kl"] = result.window_statistic
        named[get_stage(self.cfg.train.stage).counted] = result.target_tokens
        return named

    def _step(self, step: int) -> StepResult:
        # Before the batch: a rollout source's batch holds collectives (grpo's weight gather
        # and its one all-reduce), and a hang fault is documented to fire before them all.
        at_step_start(self.env.fault, step + 1, self.dist.rank)
        self._round_from(self.cfg.method.qat, step)
        work = self.source.batch(step)
        try:
            result = self.trainer.train_step(
                work.micro_batches,
                window_targets=work.window_targets,
                window_tokens=work.window_tokens,
                filler=work.filler,
            )
        except (torch.OutOfMemoryError, HostOutOfMemory) as exc:
            raise out_of_memory(
                exc,
                step=step + 1,
                rank=self.dist.rank,
                rows=self.trainer.current_rows,
                cfg=self.cfg,
                checkpoint=self.checkpointer.newest(),
                lighter=self.env.memory_advice,
            ) from None
        result.source_metrics = work.metrics
        return result

    def _round_from(self, qat: QatConfig, step: int) -> None:
        """method.qat.start_step: the steps before it train without the rounding. Read from
        the step alone, so a resumed run rounds exactly where the uninterrupted one did."""
        if qat.scheme == "none" or not qat.start_step:
            return
        rounding = step >= qat.start_step
        if rounding != self.rounding:
            set_fake_quantization(self.trainer.objective, rounding)
            self.rounding = rounding
            if rounding and step:
                self.log(f"QAT: the rounding ({qat.scheme}) is on from step {step + 1}")

    def _evaluates(self, done: int, total: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.eval_rows) and (bool(every and done % every == 0) or done == total)

    def _maybe_eval(
        self, done: int, total: int, metrics: MetricsLog | None, progress: Progress
    ) -> dict | None:
        """Evaluate after step `done` when it is due; the results (None: not due)."""
        if not self._evaluates(done, total):
            return None
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
        return result

    def _keep_best(self, last: int) -> None:
        """Early stopping: the best evaluation's model becomes the final one (its checkpoint
        is loaded, on every process) unless it is the last step's already."""
        best = self.early_stop.best_step
        if best is None or best == last:
            return
        with self.env.phase("checkpoint load", self.cfg.watchdog.slow_phase_timeout_s):
            self.checkpointer.load(self.checkpointer.root / step_dir_name(best))
        self.log(
            f"final model: step {best}'s, the best eval_loss "
            f"({self.early_stop.best_loss:.4f}; train.early_stopping_patience)"
        )

    def _save(self, step: int, meta: dict) -> None:
        with self.env.phase("checkpoint save", self.cfg.watchdog.slow_phase_timeout_s):
            self._save_now(step, meta)

    def _save_now(self, step: int, meta: dict) -> None:
        self.checkpointer.save(
            step, {**meta, "keel_version": __version__, "world_size": self.dist.world_size}
        )


def _source_metrics(result: StepResult, seconds: float) -> dict[str, float]:
    """The batch source's numbers for the step (a rollout's rewards and lengths), and for a
    source that generates, the logged step's training speed without its generation time."""
    metrics = dict(result.source_metrics)
    generation = metrics.get("generation_seconds")
    if generation is not None:
        training = max(seconds - generation, 1e-9)
        metrics["training_tokens_per_s"] = result.real_tokens / training
    return metrics
