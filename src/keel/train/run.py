"""`keel train`: preflight everything, then set up, loop, checkpoint and write the outputs.

Order matters: the config, the model path and the whole dataset are validated before the
output folder is touched, so bad input never leaves a half-written output directory.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc
import torch
import yaml

from keel import __version__
from keel.config import RunConfig, config_to_dict
from keel.config.schema import PREFERENCE_STAGES
from keel.data import PreparedData
from keel.data.template import resolve_template
from keel.distributed.launch import detect_world, slurm_rendezvous_env
from keel.distributed.parallelize import unwrap
from keel.distributed.process_group import (
    DistContext,
    init_distributed,
    main_rank_first,
    on_main,
    shutdown,
)
from keel.distributed.watchdog import Watchdog
from keel.faults import Fault, at_step_start, fault_from_env
from keel.train import checkpoint as ckpt
from keel.train.hub_fetch import fetch_hub_model
from keel.train.loop import (
    ReducedSteps,
    StepCallback,
    StepPlan,
    StepResult,
    Trainer,
    default_global_batch,
)
from keel.train.metrics import MetricsLog, Progress, memory_now, peak_rss_mb
from keel.train.model_setup import build_training_model
from keel.train.optim import (
    build_optimizer,
    build_scheduler,
    continue_schedule,
    describe_optimizer,
    scheduler_state,
)
from keel.train.output_folder import claim_output_dir
from keel.train.outputs import prepare_output_dir, write_final_outputs
from keel.train.preference import reduce_statistics, reference_mode
from keel.train.preflight import preflight
from keel.train.reference import (
    PrecomputeJob,
    ReferenceLogps,
    precompute_reference,
    reference_fingerprint,
)
from keel.train.resume import find_resume_point, run_identity
from keel.train.stops import Preemption, check_finite
from keel.train.threads import set_threads
from keel.train.watch import (
    HostOutOfMemory,
    instrument,
    out_of_memory,
    plan_memory,
    watching,
)


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float]  # per-step training loss of the steps this process ran
    summary: dict


def run_training(
    cfg: RunConfig,
    *,
    base_dir: Path | None = None,
    log: Callable[[str], None] = print,
    on_step_end: StepCallback | None = None,
    verbose: bool = True,
) -> RunResult:
    """Train as `cfg` says, in this process or as one rank of a torchrun/srun job.

    `verbose` False drops the technical set-up lines (threads, loss head, attention
    probes, optimizer layout) from `log`; the CLI shows them with --verbose.

    Raises KeelError subclasses for anything the user can fix, Diverged for a non-finite
    loss or gradient norm and Preempted after SIGTERM or train.preempt_signal (see
    keel.train.stops). The watchdog (see keel.distributed.watchdog) may end the process
    itself: exit 4 for a hang, 5 for a stall with watchdog.on_stall=abort.
    """
    fault = fault_from_env()
    world = detect_world(os.environ)
    if world.launcher == "slurm":
        os.environ.update(slurm_rendezvous_env(os.environ))
    if world.launcher == "single":
        dist = DistContext()
    else:
        dist = init_distributed(
            rank=world.rank,
            world_size=world.world_size,
            local_rank=world.local_rank,
            local_world_size=world.local_world_size,
            timeout_s=cfg.distributed.timeout_s,
            preprocess_timeout_s=cfg.distributed.preprocess_timeout_s,
            log=log,
        )
    try:
        with (
            # first: a folder in use, not keel's or not writable is refused before any work
            claim_output_dir(Path(cfg.output.dir).expanduser(), dist, log),
            watching(cfg, dist, fault) as watchdog,
            Preemption(cfg.train.preempt_signal) as preemption,
        ):
            # Only rank 0 talks; the others would repeat every line world_size times.
            env = _RunEnv(
                dist=dist,
                log=log if dist.is_main else _quiet,
                detail=log if dist.is_main and verbose else _quiet,
                on_step_end=on_step_end,
                watchdog=watchdog,
                fault=fault,
                preemption=preemption,
            )
            return _train(cfg, base_dir or Path.cwd(), env)
    finally:
        shutdown(dist)


def _quiet(_message: str) -> None:
    pass


@dataclass
class _RunEnv:
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


def _train(cfg: RunConfig, base_dir: Path, env: _RunEnv) -> RunResult:
    dist, log, slow = env.dist, env.log, cfg.watchdog.slow_phase_timeout_s
    set_threads(cfg.train.threads, dist.local_world_size, log, env.detail)
    torch.manual_seed(cfg.train.seed + dist.rank)  # dropout differs per rank, as it should
    out = Path(cfg.output.dir).expanduser()
    with env.phase("model download", cfg.distributed.preprocess_timeout_s):
        hub_dir = fetch_hub_model(cfg, dist, log)  # once per node; None: not a Hub id
    # rank 0 converts and tokenizes; the others read its cache
    with env.phase("prepare", cfg.distributed.preprocess_timeout_s), main_rank_first(dist):
        with env.watchdog.progress.memory_watched("data preparation"):  # exit 3, not OOM-kill
            checked = preflight(
                cfg, base_dir=base_dir, log=log, device=dist.device, model_dir=hub_dir
            )
    model_dir, tokenizer, data = checked.model_dir, checked.tokenizer, checked.data
    with env.phase("set-up", slow):
        # Rank 0's choice for all: `auto` measures, and measurements differ between ranks.
        precision = on_main(dist, lambda: checked.precision)
        log(f"precision: {precision.name} ({precision.reason})")
        identity = run_identity(cfg, model_dir, precision.name, data.fingerprint)
        configured_batch = cfg.train.global_batch_size or default_global_batch(
            cfg.train.micro_batch_size, cfg.train.grad_accum, dist.world_size
        )
        steps_for = functools.partial(_total_steps, cfg, len(data.train))
        resume = on_main(
            dist,
            lambda: find_resume_point(cfg, out, identity, configured_batch, steps_for, log),
        )
        planned = on_main(dist, lambda: plan_memory(cfg, model_dir, dist, precision.name, log))
    global_batch = resume.global_batch if resume else configured_batch

    with env.phase("load", slow):
        built = build_training_model(
            cfg, model_dir, dist, precision, env.detail, strategy=planned.strategy
        )
    if cfg.watchdog.enabled or env.fault is not None:
        instrument(built.model, env.watchdog, env.fault, dist.rank)
    loaded_peak_mb = peak_rss_mb()  # the loading high-water mark, before any training
    env.detail(f"model ready: peak RSS so far {loaded_peak_mb:.0f} MB (rank 0)")
    plan = _step_plan(cfg, len(data.train), global_batch)
    total_steps = plan.total_steps(cfg.train.epochs, cfg.train.max_steps)
    optimizer = build_optimizer(built.objective, cfg.train)
    env.detail(describe_optimizer(optimizer, cfg.train.optimizer))
    trainer = Trainer(
        objective=built.objective,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.train, total_steps),
        precision=precision,
        device=dist.device,
        pad_id=tokenizer.pad_token_id,
        max_grad_norm=cfg.train.max_grad_norm,
        dist=dist,
        progress=env.watchdog.progress,
        padding_free=built.padding_free,
        strategy=built.strategy,
    )
    if trainer.scaler.is_enabled():
        env.detail(
            f"precision: fp16 with dynamic loss scaling ({_describe_scaler(trainer.scaler)})"
        )
    references = None
    if reference_mode(cfg.train.stage, cfg.preference) == "precompute":
        # Before the checkpoint is loaded: the policy still holds the base weights.
        with env.phase("reference pass", slow):
            references = _precompute_references(cfg, trainer, data, model_dir, env)
    resume_from = resume.checkpoint if resume else None
    with env.phase("checkpoint load", slow):
        start_step = _restore(trainer, resume_from, dist, log) if resume_from else 0
    if resume:  # the schedule of this run's length, which an extension changed
        moved = continue_schedule(trainer.scheduler, cfg.train, total_steps, resume.total_steps)
        if moved:
            log(moved)

    def prepare() -> list[Path]:
        removed = prepare_output_dir(cfg, out, resume_from, log)
        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return removed

    with env.phase("set-up", slow):
        for partial in on_main(dist, prepare):
            log(f"removed an interrupted checkpoint save: {partial}")
    per_process = math.ceil(global_batch / dist.world_size)
    log(f"steps: {plan.schedule(cfg.train.epochs, cfg.train.max_steps)}")
    log(
        f"training: {len(data.train)} rows, global batch {global_batch} rows over "
        f"{dist.world_size} process(es) (~{per_process} per process, micro-batches of "
        f"{cfg.train.micro_batch_size}), {plan.steps_per_epoch} steps/epoch, {total_steps} "
        f"steps, starting at step {start_step}"
    )
    idle = plan.idle_warning(dist.world_size)
    if idle:
        log(f"warning: {idle}")
    env.memory_advice = planned.lighter
    loop = _Loop(cfg, out, trainer, plan, data, env, references)
    env.preemption.enter_loop()  # a signal now stops the run at a step's end, with a save
    losses, stats = loop.run(
        start_step,
        total_steps,
        {
            "global_batch": global_batch,
            "total_steps": total_steps,
            "config": config_to_dict(cfg),  # a resume names each key that differs
            **identity.to_meta(),
        },
    )
    stats["load_peak_rss_mb"] = loaded_peak_mb
    _keep_training_template(cfg, tokenizer, base_dir, data)
    with env.phase("outputs", slow):
        summary = write_final_outputs(
            cfg,
            out,
            built,
            tokenizer,
            model_dir,
            dist,
            log,
            steps=total_steps,
            stats=stats,
            precision=precision.name,
        )
    return RunResult(output_dir=out, steps=total_steps, losses=losses, summary=summary)


def _step_plan(cfg: RunConfig, num_rows: int, global_batch: int) -> StepPlan:
    return StepPlan(
        num_rows=num_rows,
        global_batch=global_batch,
        micro_batch_size=cfg.train.micro_batch_size,
        seed=cfg.train.seed,
        shuffle=cfg.data.shuffle,
    )


def _total_steps(cfg: RunConfig, num_rows: int, global_batch: int) -> int:
    """The run's optimizer steps for `global_batch` (train.max_steps wins over epochs)."""
    return _step_plan(cfg, num_rows, global_batch).total_steps(
        cfg.train.epochs, cfg.train.max_steps
    )


def _keep_training_template(cfg: RunConfig, tokenizer, base_dir: Path, data: PreparedData):
    """The saved tokenizer carries the chat template the model was trained with, so chat,
    serve and export render prompts the same way (data.template chatml or a .jinja file
    would otherwise be lost, and the tokenizer's own one used)."""
    if data.report.template in ("none", "tokenizer"):
        return
    template, _ = resolve_template(cfg.data.template, tokenizer, base_dir)
    tokenizer.chat_template = template.text


def _precompute_references(
    cfg: RunConfig, trainer: Trainer, data: PreparedData, model_dir: Path, env: _RunEnv
) -> dict[str, ReferenceLogps]:
    splits = {"train": data.train}
    if data.eval is not None:
        splits["eval"] = data.eval
    key = reference_fingerprint(data.fingerprint, model_dir, trainer.precision.name)
    job = PrecomputeJob(
        folder=Path(cfg.model.cache_dir).expanduser() / "reference" / key,
        splits={name: [split[i] for i in range(len(split))] for name, split in splits.items()},
        micro_batch_size=cfg.train.micro_batch_size,
    )
    return precompute_reference(trainer, job, env.dist, env.log)


def _describe_scaler(scaler: torch.amp.GradScaler) -> str:
    name = type(scaler).__name__
    why = "; overflow checks agreed over the ranks' shards" if name == "ShardedGradScaler" else ""
    return f"{name}, initial scale {scaler.get_scale():g}{why}"


def _restore(trainer: Trainer, checkpoint: Path, dist: DistContext, log) -> int:
    state = ckpt.load_checkpoint(
        checkpoint, module=trainer.objective, optimizer=trainer.optimizer, dist=dist
    )
    trainer.scheduler.load_state_dict(state.scheduler)
    scale = ""
    if state.scaler and trainer.scaler.is_enabled():
        trainer.scaler.load_state_dict(state.scaler)
        scale = f" (fp16 loss scale {trainer.scaler.get_scale():g})"
    if state.rng is not None:
        ckpt.restore_rng(state.rng)
    log(f"resumed from {checkpoint} at step {state.step}{scale}")
    return state.step


class _Loop:
    """Steps, logging, evaluation and periodic checkpoints for one run (every process)."""

    def __init__(
        self,
        cfg: RunConfig,
        out: Path,
        trainer: Trainer,
        plan: StepPlan,
        data: PreparedData,
        env: _RunEnv,
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
        newest = ckpt.complete_checkpoints(self.out)
        check_finite(reduced.losses, reduced.grad_norms, first, newest[-1] if newest else None)

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
