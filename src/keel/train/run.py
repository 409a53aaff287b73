"""`keel train`: preflight everything, set up, run the loop (`keel.train.run_loop`), then
write the outputs.

Order matters: the config, the model path and the whole dataset are validated before the
output folder is touched, so bad input never leaves a half-written output directory.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from keel.config import RunConfig, config_to_dict
from keel.data import PreparedData
from keel.data.template import resolve_template
from keel.distributed.launch import detect_world, slurm_rendezvous_env
from keel.distributed.process_group import (
    DistContext,
    init_distributed,
    main_rank_first,
    on_main,
    shutdown,
)
from keel.faults import fault_from_env
from keel.train import checkpoint as ckpt
from keel.train.hub_fetch import fetch_hub_model
from keel.train.loop import (
    StepCallback,
    StepPlan,
    Trainer,
    default_global_batch,
)
from keel.train.metrics import peak_rss_mb
from keel.train.model_setup import build_training_model
from keel.train.optim import (
    build_optimizer,
    build_scheduler,
    continue_schedule,
    describe_optimizer,
)
from keel.train.output_folder import claim_output_dir
from keel.train.outputs import prepare_output_dir, write_final_outputs
from keel.train.preference import reference_mode
from keel.train.preflight import preflight
from keel.train.reference import (
    PrecomputeJob,
    ReferenceLogps,
    precompute_reference,
    reference_fingerprint,
)
from keel.train.resume import find_resume_point, run_identity
from keel.train.run_loop import RunEnv, TrainingLoop
from keel.train.stops import Preemption
from keel.train.threads import set_threads
from keel.train.watch import (
    instrument,
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


def _train(cfg: RunConfig, base_dir: Path, env: RunEnv) -> RunResult:
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
    loop = TrainingLoop(cfg, out, trainer, plan, data, env, references)
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
    cfg: RunConfig, trainer: Trainer, data: PreparedData, model_dir: Path, env: RunEnv
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
