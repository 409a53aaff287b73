"""`keel train`: preflight everything, set up, run the loop (`keel.train.run_loop`), then
write the outputs.

Order matters: the config, the model path and the whole dataset are validated before the
output folder is touched, so bad input never leaves a half-written output directory.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from keel.checkpoint.checkpointer import Checkpointer, ProcessStateful, StatefulParts
from keel.checkpoint.identity import RunIdentity, run_identity
from keel.config import RunConfig, config_to_dict
from keel.data import PreparedData
from keel.data.stream import StreamedData
from keel.data.template import resolve_template
from keel.distributed.launch import detect_world
from keel.distributed.parallel_dims import data_parallel_size
from keel.distributed.process_group import (
    DistContext,
    join_world,
    main_rank_first,
    on_main,
    shutdown,
)
from keel.faults import fault_from_env
from keel.models.loading import import_model_libraries
from keel.precision import Precision
from keel.stages.registry import get_stage
from keel.train.batch_source import (
    BATCH_SOURCE,
    BatchSource,
    DatasetBatchSource,
    StepPlan,
    StreamBatchSource,
    default_global_batch,
    eval_rows,
)
from keel.train.cadence import per_epoch_cadence
from keel.train.completions_log import CompletionsLog
from keel.train.early_stop import track_early_stopping
from keel.train.hub_fetch import fetch_hub_model
from keel.train.loop import StepCallback, Trainer
from keel.train.metrics import RunStats, peak_rss_mb
from keel.train.model_setup import TrainingModel, build_training_model, reference_source_of
from keel.train.optim import (
    build_optimizer,
    build_scheduler,
    continue_schedule,
    describe_optimizer,
)
from keel.train.output_folder import claim_output_dir
from keel.train.outputs import prepare_output_dir, write_final_outputs
from keel.train.preflight import Preflight, preflight
from keel.train.reference import PrecomputeJob, ReferenceLogps, precompute_reference
from keel.train.resume import ResumePoint, find_resume_point
from keel.train.rollout_rewards import run_trainer_state
from keel.train.rollout_rows import refuse_uneven_prompts
from keel.train.rollouts import RolloutBatchSource, RolloutContext
from keel.train.run_loop import RunEnv, TrainingLoop
from keel.train.same_data import check_same_data
from keel.train.stops import Preemption
from keel.train.threads import set_threads
from keel.train.watch import PlannedRun, instrument, plan_memory, watching


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
    if world.launcher == "single":
        dist = DistContext()
    else:
        dist = join_world(
            world,
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
            env = RunEnv(
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


@dataclass(frozen=True, kw_only=True)
class _Run:
    """What every set-up step reads: the config, who runs it, and where."""

    cfg: RunConfig
    env: RunEnv
    base_dir: Path  # relative data and template paths are read from here
    out: Path  # the output folder (claimed by run_training)

    @property
    def slow(self) -> float | None:
        """Seconds without progress before a set-up phase counts as a hang."""
        return self.cfg.watchdog.slow_phase_timeout_s


@dataclass(frozen=True, kw_only=True)
class _Decisions:
    """What rank 0 decides for every rank before the model is built."""

    precision: Precision
    identity: RunIdentity
    resume: ResumePoint | None  # the checkpoint this run continues, if any
    memory: PlannedRun  # the memory plan's strategy and lighter options
    global_batch: int  # rows per optimizer step (a resumed run keeps its checkpoint's)


@dataclass(frozen=True, kw_only=True)
class _Schedule:
    """Which rows each step takes, and how many steps the run has."""

    plan: StepPlan
    total_steps: int


def _train(cfg: RunConfig, base_dir: Path, env: RunEnv) -> RunResult:
    """The run's story: check the inputs, decide, build the model and the trainer, find the
    rows and the state to start from, run the steps, write the outputs."""
    run = _Run(cfg=cfg, env=env, base_dir=base_dir, out=Path(cfg.output.dir).expanduser())
    set_threads(cfg.train.threads, env.dist.local_world_size, env.log, env.detail)
    # Dropout differs per rank, as it should, except within a tensor-parallel group, whose
    # processes compute the same activations (each drops the same elements).
    torch.manual_seed(cfg.train.seed + env.dist.rank // cfg.distributed.tensor_parallel)
    checked = _check_inputs(run)
    decided = _decide(run, checked)
    built, loaded_peak_mb = _load_model(run, checked.model_dir, decided)
    schedule = _schedule(cfg, checked.data.num_rows, decided.global_batch)
    trainer = _build_trainer(run, built, decided.precision, checked.tokenizer, schedule)
    references = _reference_pass(run, trainer, checked)
    source = _batch_source(run, schedule, checked, references, trainer, decided.resume)
    checkpointer = _checkpointer(run, trainer, source)
    start_step = _resume(run, checkpointer, decided.resume, schedule)
    _prepare_output(run, decided.resume)
    _log_schedule(run, schedule, start_step)
    env.memory_advice = decided.memory.lighter
    loop = TrainingLoop(
        per_epoch_cadence(cfg, schedule.plan.steps_per_epoch, env.log),
        trainer,
        env,
        source=source,
        checkpointer=checkpointer,
        eval_rows=eval_rows(checked.data, references),
    )
    env.preemption.enter_loop()  # a signal now stops the run at a step's end, with a save
    losses, stats = loop.run(start_step, schedule.total_steps, _run_meta(cfg, decided, schedule))
    stats.load_peak_rss_mb = loaded_peak_mb
    summary = _write_outputs(run, checked, built, decided.precision, stats)
    return RunResult(output_dir=run.out, steps=stats.steps, losses=losses, summary=summary)


def _check_inputs(run: _Run) -> Preflight:
    """The model fetched (once per node) and the config, model and whole dataset checked;
    rank 0 converts and tokenizes, the others then read its cache."""
    cfg, env, dist = run.cfg, run.env, run.env.dist
    with env.phase("model download", cfg.distributed.preprocess_timeout_s):
        hub_dir = fetch_hub_model(cfg, dist, env.log)  # once per node; None: not a Hub id
    if dist.distributed:  # one process imports these where it first uses them
        import_model_libraries(adapters=cfg.method.uses_adapter)
    with env.phase("prepare", cfg.distributed.preprocess_timeout_s), main_rank_first(dist):
        with env.watchdog.progress.memory_watched("data preparation"):  # exit 3, not OOM-kill
            checked = preflight(
                cfg, base_dir=run.base_dir, log=env.log, device=dist.device, model_dir=hub_dir
            )
    with env.phase("prepare", cfg.distributed.preprocess_timeout_s):  # once all have prepared
        check_same_data(checked.data.fingerprint, dist)
    return checked


def _decide(run: _Run, checked: Preflight) -> _Decisions:
    """Precision, the checkpoint to resume and the memory plan: rank 0's, for all ranks."""
    cfg, dist, log = run.cfg, run.env.dist, run.env.log
    model_dir, data = checked.model_dir, checked.data
    with run.env.phase("set-up", run.slow):
        # Rank 0's choice for all: `auto` measures, and measurements differ between ranks.
        precision = on_main(dist, lambda: checked.precision)
        log(f"precision: {precision.name} ({precision.reason})")
        identity = run_identity(cfg, model_dir, precision, data.fingerprint)
        # model set-up makes the context-parallel groups; the config already says them
        d = cfg.distributed
        dp_size = data_parallel_size(dist.world_size, d.context_parallel, d.tensor_parallel)
        configured_batch = cfg.train.global_batch_size or default_global_batch(
            cfg.train.micro_batch_size, cfg.train.grad_accum, dp_size
        )
        steps_for = functools.partial(_total_steps, cfg, data.num_rows)
        resume = on_main(
            dist,
            lambda: find_resume_point(cfg, run.out, identity, configured_batch, steps_for, log),
        )
        longest = data.longest_prompt()
        planned = on_main(
            dist, lambda: plan_memory(cfg, model_dir, dist, precision, log, longest_prompt=longest)
        )
    global_batch = resume.global_batch if resume else configured_batch
    refuse_uneven_prompts(cfg.train.stage, global_batch, dp_size)
    return _Decisions(
        precision=precision,
        identity=identity,
        resume=resume,
        memory=planned,
        global_batch=global_batch,
    )


def _load_model(run: _Run, model_dir: Path, decided: _Decisions) -> tuple[TrainingModel, float]:
    """The model on this process's device, sharded or replicated as planned (watched when
    the watchdog or a fault is on), and the loading's peak RSS in MB."""
    cfg, env = run.cfg, run.env
    with env.phase("load", run.slow):
        built = build_training_model(
            cfg,
            model_dir,
            env.dist,
            decided.precision,
            env.detail,
            strategy=decided.memory.strategy,
        )
    if cfg.watchdog.enabled or env.fault is not None:
        instrument(built.model, env.watchdog, env.fault, env.dist.rank)
    loaded_peak_mb = peak_rss_mb()  # the loading high-water mark, before any training
    env.detail(f"model ready: peak RSS so far {loaded_peak_mb:.0f} MB (rank 0)")
    return built, loaded_peak_mb


def _schedule(cfg: RunConfig, num_rows: int | None, global_batch: int) -> _Schedule:
    plan = StepPlan.of(cfg, num_rows, global_batch)
    return _Schedule(plan=plan, total_steps=plan.total_steps(cfg.train.epochs, cfg.train.max_steps))


def _total_steps(cfg: RunConfig, num_rows: int | None, global_batch: int) -> int:
    """The run's optimizer steps for `global_batch` (train.max_steps wins over epochs)."""
    return _schedule(cfg, num_rows, global_batch).total_steps


def _build_trainer(
    run: _Run, built: TrainingModel, precision: Precision, tokenizer, schedule: _Schedule
) -> Trainer:
    """The optimizer, its learning-rate schedule over the run's steps, and the trainer."""
    cfg, env, dist = run.cfg, run.env, run.env.dist
    plus = cfg.method.lora.plus_lr_ratio if cfg.method.uses_lora else None
    optimizer = build_optimizer(built.objective, cfg.train, lora_plus_ratio=plus)
    env.detail(describe_optimizer(optimizer, cfg.train.optimizer))
    trainer = Trainer(
        objective=built.objective,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.train, schedule.total_steps),
        precision=precision,
        device=dist.device,
        pad_id=tokenizer.pad_token_id,
        max_grad_norm=cfg.train.max_grad_norm,
        dist=dist,
        progress=env.watchdog.progress,
        padding_free=built.padding_free,
        strategy=built.strategy,
        replicated=built.replicated,
        tp_partial=built.tp_partial,
    )
    if trainer.scaler.is_enabled():
        env.detail(
            f"precision: fp16 with dynamic loss scaling ({_describe_scaler(trainer.scaler)})"
        )
    return trainer


def _reference_pass(
    run: _Run, trainer: Trainer, checked: Preflight
) -> dict[str, ReferenceLogps] | None:
    """Each split's reference log-probs when the stage precomputes them, else None."""
    if reference_source_of(run.cfg) != "precompute":
        return None
    # Before the checkpoint is loaded: the policy still holds the base weights.
    with run.env.phase("reference pass", run.slow):
        job = PrecomputeJob.of(run.cfg, checked.data, checked.model_dir, trainer.precision)
        return precompute_reference(trainer, job, run.env.dist, run.env.log)


def _batch_source(
    run: _Run,
    schedule: _Schedule,
    checked: Preflight,
    references: dict[str, ReferenceLogps] | None,
    trainer: Trainer,
    resume: ResumePoint | None,
) -> BatchSource:
    """Where each step's rows come from: for a stage trained on prompts (grpo), rollouts the
    policy samples each step and the reward functions score; else the training split."""
    cfg, dist = run.cfg, run.env.dist
    if isinstance(checked.data, StreamedData):
        stream = checked.data.open(run.env.log)
        return StreamBatchSource(stream, schedule.plan, dp_rank=dist.dp_rank, dp_size=dist.dp_size)
    if get_stage(cfg.train.stage).unit != "prompt":
        return _dataset_source(schedule, checked.data, references, dist)
    settings = cfg.stage_settings
    every = settings.log_completions_every if dist.is_main else 0  # rank 0's prompts
    context = RolloutContext(
        trainer=trainer,
        tokenizer=checked.tokenizer,
        rewards=checked.rewards,
        hang_limit=cfg.watchdog.hang_timeout_s,
        trainer_state=run_trainer_state(cfg, schedule.total_steps, dist),
        completions=CompletionsLog.open(run.out, every, resume_step=resume.step if resume else 0),
        fault=run.env.fault,
    )
    return RolloutBatchSource(schedule.plan, checked.data.train, settings, context)


def _dataset_source(
    schedule: _Schedule,
    data: PreparedData,
    references: dict[str, ReferenceLogps] | None,
    dist: DistContext,
) -> DatasetBatchSource:
    """The training split in the schedule's order: this data-parallel rank's share."""
    return DatasetBatchSource(
        schedule.plan,
        data.train,
        dp_rank=dist.dp_rank,
        dp_size=dist.dp_size,
        reference=references["train"] if references else None,
    )


def _checkpointer(run: _Run, trainer: Trainer, source: BatchSource) -> Checkpointer:
    """The checkpointer of the trainer's parts, the batch source and early stopping."""
    parts = StatefulParts(
        module=trainer.objective,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        scaler=trainer.scaler,
    )
    checkpointer = Checkpointer(
        parts, output_dir=run.out, keep_last=run.cfg.output.keep_last, dist=run.env.dist
    )
    # Optional: checkpoints written before the source was a part hold no state for it, and
    # the dataset's order needs none (it is a function of the step and train.seed).
    checkpointer.register(BATCH_SOURCE, source, missing_ok=True)
    track_early_stopping(checkpointer, run.cfg.train)
    if isinstance(source, ProcessStateful):  # a rollout in flight differs per process
        checkpointer.register_per_process(BATCH_SOURCE, source)
    return checkpointer


def _resume(
    run: _Run, checkpointer: Checkpointer, resume: ResumePoint | None, schedule: _Schedule
) -> int:
    """The first step to run: 0, or the checkpoint's after loading it into the parts."""
    with run.env.phase("checkpoint load", run.slow):
        start_step = _restore(checkpointer, resume.checkpoint, run.env.log) if resume else 0
    if resume:  # the schedule of this run's length, which an extension changed
        moved = continue_schedule(
            checkpointer.parts.scheduler, run.cfg.train, schedule.total_steps, resume.total_steps
        )
        if moved:
            run.env.log(moved)
    return start_step


def _restore(checkpointer: Checkpointer, checkpoint: Path, log) -> int:
    restored = checkpointer.load(checkpoint)
    scale = ""
    if restored.scaler_restored:
        scale = f" (fp16 loss scale {checkpointer.parts.scaler.get_scale():g})"
    log(f"resumed from {checkpoint} at step {restored.step}{scale}")
    return restored.step


def _prepare_output(run: _Run, resume: ResumePoint | None) -> None:
    """On rank 0: clear interrupted saves (not the one resumed) and write config.yaml."""
    cfg, out, log = run.cfg, run.out, run.env.log
    resume_from = resume.checkpoint if resume else None

    def prepare() -> list[Path]:
        removed = prepare_output_dir(cfg, out, resume_from, log)
        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return removed

    with run.env.phase("set-up", run.slow):
        for partial in on_main(run.env.dist, prepare):
            log(f"removed an interrupted checkpoint save: {partial}")


def _log_schedule(run: _Run, schedule: _Schedule, start_step: int) -> None:
    """Say how long the run is, how its batch is split, and whether a process idles."""
    dist, total = run.env.dist, schedule.total_steps
    for line in schedule.plan.describe(
        run.cfg.train, dist.dp_size, total, start_step, dist.cp_size, dist.tp_size
    ):
        run.env.log(line)


def _run_meta(cfg: RunConfig, decided: _Decisions, schedule: _Schedule) -> dict:
    """What each checkpoint records of the run, to check a resume against."""
    return {
        "global_batch": decided.global_batch,
        "total_steps": schedule.total_steps,
        "config": config_to_dict(cfg),  # a resume names each key that differs
        **decided.identity.to_meta(),
    }


def _write_outputs(
    run: _Run,
    checked: Preflight,
    built: TrainingModel,
    precision: Precision,
    stats: RunStats,
) -> dict:
    """The trained model, its tokenizer (with the chat template it trained with) and the
    run's summary, written into the output folder; returns the summary."""
    cfg, env = run.cfg, run.env
    _keep_training_template(cfg, checked.tokenizer, run.base_dir, checked.data)
    with env.phase("outputs", run.slow):
        return write_final_outputs(
            cfg,
            run.out,
            built,
            checked.tokenizer,
            checked.model_dir,
            env.dist,
            env.log,
            steps=stats.steps,
            stats=stats,
            precision=precision,
        )


def _keep_training_template(cfg: RunConfig, tokenizer, base_dir: Path, data: PreparedData):
    """The saved tokenizer carries the chat template the model was trained with, so chat,
    serve and export render prompts the same way (data.template chatml or a .jinja file
    would otherwise be lost, and the tokenizer's own one used)."""
    if data.report.template in ("none", "tokenizer"):
        return
    template, _ = resolve_template(cfg.data.template, tokenizer, base_dir)
    tokenizer.chat_template = template.text


def _describe_scaler(scaler: torch.amp.GradScaler) -> str:
    name = type(scaler).__name__
    why = "; overflow checks agreed over the ranks' shards" if name == "ShardedGradScaler" else ""
    return f"{name}, initial scale {scaler.get_scale():g}{why}"
