"""`keel train`: preflight everything, then set up, loop, checkpoint and write the outputs.

Order matters: the config, the model path and the whole dataset are validated before the
output folder is touched, so bad input never leaves a half-written output directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import torch
import yaml

from keel import __version__
from keel.config import RunConfig, config_to_dict
from keel.data import PreparedData, prepare_data
from keel.distributed.launch import detect_world, slurm_rendezvous_env
from keel.distributed.process_group import (
    DistContext,
    init_distributed,
    main_rank_first,
    on_main,
    shutdown,
)
from keel.errors import CheckpointError, KeelError
from keel.models import load_tokenizer, resolve_model_path
from keel.train import checkpoint as ckpt
from keel.train.loop import StepCallback, StepPlan, Trainer
from keel.train.metrics import MetricsLog, Progress, memory_now, peak_rss_mb
from keel.train.model_setup import build_training_model
from keel.train.optim import build_optimizer, build_scheduler
from keel.train.outputs import FINAL_MARKER, write_final_outputs
from keel.train.precision import resolve_precision


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float]  # per-step training loss of the steps this process ran
    summary: dict


def run_training(cfg: RunConfig, *, base_dir: Path | None = None,
                 log: Callable[[str], None] = print,
                 on_step_end: StepCallback | None = None) -> RunResult:
    """Train as `cfg` says, in this process or as one rank of a torchrun/srun job.

    Raises KeelError subclasses for anything the user can fix.
    """
    world = detect_world(os.environ)
    if world.launcher == "single":
        return _train(cfg, base_dir or Path.cwd(), DistContext(), log, on_step_end)
    if world.launcher == "slurm":
        os.environ.update(slurm_rendezvous_env(os.environ))
    dist = init_distributed(rank=world.rank, world_size=world.world_size,
                            local_rank=world.local_rank,
                            local_world_size=world.local_world_size,
                            timeout_s=cfg.distributed.timeout_s,
                            preprocess_timeout_s=cfg.distributed.preprocess_timeout_s, log=log)
    try:
        # Only rank 0 talks; the others would repeat every line world_size times.
        return _train(cfg, base_dir or Path.cwd(), dist, log if dist.is_main else _quiet,
                      on_step_end)
    finally:
        shutdown(dist)


def _quiet(_message: str) -> None:
    pass


def _train(cfg: RunConfig, base_dir: Path, dist: DistContext, log,
           on_step_end: StepCallback | None) -> RunResult:
    _set_threads(cfg.train.threads, dist.local_world_size, log)
    torch.manual_seed(cfg.train.seed + dist.rank)  # dropout differs per rank, as it should
    out = Path(cfg.output.dir).expanduser()
    global_batch = cfg.train.global_batch_size or cfg.train.micro_batch_size * cfg.train.grad_accum
    with main_rank_first(dist):  # rank 0 converts and tokenizes; the others read its cache
        model_dir, tokenizer, data = preflight(cfg, base_dir=base_dir, log=log)
    resume_from = on_main(dist, lambda: _resume_point(cfg, out, data.fingerprint, global_batch))
    precision = on_main(dist, lambda: resolve_precision(cfg.train.precision, dist.device))
    log(f"precision: {precision.name} ({precision.reason})")

    built = build_training_model(cfg, model_dir, dist, precision, log)
    loaded_peak_mb = peak_rss_mb()  # the loading high-water mark, before any training
    log(f"model ready: peak RSS so far {loaded_peak_mb:.0f} MB (rank 0)")
    plan = StepPlan(num_rows=len(data.train), global_batch=global_batch,
                    micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed,
                    shuffle=cfg.data.shuffle)
    total_steps = plan.total_steps(cfg.train.epochs, cfg.train.max_steps)
    optimizer = build_optimizer(built.objective, cfg.train)
    trainer = Trainer(objective=built.objective, optimizer=optimizer,
                      scheduler=build_scheduler(optimizer, cfg.train, total_steps),
                      precision=precision, device=dist.device, pad_id=tokenizer.pad_token_id,
                      max_grad_norm=cfg.train.max_grad_norm, dist=dist)
    start_step = _restore(trainer, resume_from, dist, log) if resume_from else 0

    def prepare() -> list[Path]:
        removed = _prepare_output_dir(cfg, out, resume_from)
        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return removed

    for partial in on_main(dist, prepare):
        log(f"removed an interrupted checkpoint save: {partial}")
    log(f"training: {len(data.train)} rows, global batch {global_batch} rows over "
        f"{dist.world_size} process(es), {plan.steps_per_epoch} steps/epoch, "
        f"{total_steps} steps, starting at step {start_step}")
    loop = _Loop(cfg, out, trainer, plan, data, dist, log, on_step_end)
    losses, stats = loop.run(start_step, total_steps, {"data_fingerprint": data.fingerprint,
                                                        "global_batch": global_batch})
    stats["load_peak_rss_mb"] = loaded_peak_mb
    summary = write_final_outputs(cfg, out, built, tokenizer, model_dir, dist, log,
                                  steps=total_steps, stats=stats, precision=precision.name)
    return RunResult(output_dir=out, steps=total_steps, losses=losses, summary=summary)


def preflight(cfg: RunConfig, *, base_dir: Path,
              log: Callable[[str], None] = print) -> tuple[Path, object, PreparedData]:
    """Resolve the model and validate + tokenize all data, touching no output folder.

    Shared by `keel train` and `keel validate`, so both check exactly the same things.
    """
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir, log=log)
    tokenizer = load_tokenizer(model_dir)
    data = prepare_data(cfg.data, tokenizer, stage=cfg.train.stage,
                        cache_dir=Path(cfg.model.cache_dir).expanduser(), base_dir=base_dir,
                        seed=cfg.train.seed, log=log)
    return model_dir, tokenizer, data


def _set_threads(requested: int, local_processes: int, log) -> None:
    # torchrun sets OMP_NUM_THREADS=1 unless told otherwise; choose deliberately instead:
    # this process's share of the cores it may run on.
    threads = requested or max(1, len(os.sched_getaffinity(0)) // max(local_processes, 1))
    torch.set_num_threads(threads)
    log(f"threads: {threads} per process")


def _resume_point(cfg: RunConfig, out: Path, data_fingerprint: str,
                  global_batch: int) -> Path | None:
    if cfg.train.resume == "never":
        return None
    if cfg.train.resume != "auto":
        chosen = Path(cfg.train.resume)
    else:
        found = ckpt.complete_checkpoints(out)
        if not found:
            return None
        chosen = found[-1]
    meta = ckpt.read_meta(chosen)
    if meta.get("data_fingerprint") != data_fingerprint:
        raise CheckpointError(
            f"{chosen} was trained on different data (or data settings) than this config "
            f"gives; resuming would not continue the same run. Set train.resume=never and "
            f"a new output.dir to start over, or restore the original data/config")
    saved_batch = meta.get("global_batch", global_batch)
    if saved_batch != global_batch:
        raise CheckpointError(
            f"{chosen} was trained with a global batch of {saved_batch} rows, this config "
            f"gives {global_batch}; set train.global_batch_size={saved_batch} to continue it "
            f"(any number of processes works)")
    return chosen


def _prepare_output_dir(cfg: RunConfig, out: Path, resume_from: Path | None) -> list[Path]:
    if out.exists() and any(out.iterdir()) and resume_from is None:
        # An interrupted keel run that never completed a checkpoint has nothing to lose:
        # with resume=auto it starts over. Anything else needs an explicit overwrite.
        unfinished_run = (out / "config.yaml").is_file() and not (out / FINAL_MARKER).exists()
        if unfinished_run and cfg.train.resume == "auto":
            return ckpt.clear_partial_checkpoints(out)
        if not cfg.output.overwrite:
            raise KeelError(
                f"output.dir {out} is not empty and there is no checkpoint to resume from; "
                f"choose another output.dir, or set output.overwrite=true to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    removed = ckpt.clear_partial_checkpoints(out)
    return removed


def _restore(trainer: Trainer, checkpoint: Path, dist: DistContext, log) -> int:
    state = ckpt.load_checkpoint(checkpoint, module=trainer.objective,
                                 optimizer=trainer.optimizer, dist=dist)
    trainer.scheduler.load_state_dict(state.scheduler)
    if state.rng is not None:
        ckpt.restore_rng(state.rng)
    log(f"resumed from {checkpoint} at step {state.step}")
    return state.step


class _Loop:
    """Steps, logging, evaluation and periodic checkpoints for one run (every process)."""

    def __init__(self, cfg: RunConfig, out: Path, trainer: Trainer, plan: StepPlan,
                 data: PreparedData, dist: DistContext, log, on_step_end):
        self.cfg, self.out, self.trainer, self.plan = cfg, out, trainer, plan
        self.data, self.dist, self.log, self.on_step_end = data, dist, log, on_step_end
        # Every process knows every row's size, so the global batch's target count needs
        # no communication.
        table = data.train.with_format("arrow")
        self.row_targets = table["num_targets"].to_pylist()
        self.row_tokens = pc.list_value_length(table["input_ids"]).to_pylist()
        # Materialised once: the eval split does not change during a run.
        self.eval_rows = [data.eval[i] for i in range(len(data.eval))] if data.eval else []

    def run(self, start: int, total: int, meta: dict) -> tuple[list[float], dict]:
        out_cfg = self.cfg.output
        main = self.dist.is_main
        metrics = MetricsLog(self.out, resume_step=start,
                             tensorboard="tensorboard" in out_cfg.loggers) if main else None
        progress = Progress(total=total, initial=start, enabled=main)
        losses: list[float] = []
        stats = {"real_tokens": 0, "target_tokens": 0, "train_seconds": 0.0, "loss": None}
        window = {"real": 0, "seconds": 0.0}
        try:
            for step in range(start, total):
                result = self._step(step)
                losses.append(result.loss)
                for key, value in (("real_tokens", result.real_tokens),
                                   ("target_tokens", result.target_tokens),
                                   ("train_seconds", result.seconds)):
                    stats[key] += value
                stats["loss"] = result.loss
                window["real"] += result.real_tokens
                window["seconds"] += result.seconds
                done = step + 1
                tokens_per_s = window["real"] / max(window["seconds"], 1e-9)
                progress.update(result.loss, result.lr, tokens_per_s)
                record = None
                if done % out_cfg.log_every == 0 or done == total:
                    record = {"step": done, "epoch": round(self.plan.epoch_of(done), 4),
                              "loss": result.loss, "lr": result.lr,
                              "grad_norm": result.grad_norm, "tokens_per_s": tokens_per_s,
                              "target_tokens": result.target_tokens, **memory_now()}
                    window = {"real": 0, "seconds": 0.0}
                    if metrics is not None:
                        metrics.write(record)
                self._maybe_eval(done, total, metrics, progress)
                if (out_cfg.save_every and done % out_cfg.save_every == 0) or done == total:
                    self._save(done, meta)
                if self.on_step_end is not None:
                    self.on_step_end(done, record or {"step": done, "loss": result.loss})
        finally:
            progress.close()
            if metrics is not None:
                metrics.close()
        return losses, stats

    def _step(self, step: int):
        window = self.plan.window(step)
        micro = self.plan.micro_batches(step, self.dist.rank, self.dist.world_size)
        rows = [[self.data.train[i] for i in mb] for mb in micro]
        return self.trainer.train_step(
            rows, window_targets=sum(self.row_targets[i] for i in window),
            window_tokens=sum(self.row_tokens[i] for i in window),
            filler=self.data.train[window[0]])

    def _maybe_eval(self, done: int, total: int, metrics: MetricsLog | None,
                    progress: Progress):
        if not self.eval_rows:
            return
        every = self.cfg.train.eval_every
        if (every and done % every == 0) or done == total:
            result = self.trainer.evaluate(self.eval_rows, self.cfg.train.micro_batch_size)
            if metrics is not None:
                metrics.write({"step": done, **result})
            progress.write(f"step {done}: eval_loss {result['eval_loss']:.4f} "
                           f"ppl {result['eval_ppl']:.2f}")

    def _save(self, step: int, meta: dict) -> None:
        ckpt.save_checkpoint(self.out, step, module=self.trainer.objective,
                             optimizer=self.trainer.optimizer,
                             scheduler=self.trainer.scheduler.state_dict(),
                             meta={**meta, "keel_version": __version__,
                                   "world_size": self.dist.world_size},
                             keep_last=self.cfg.output.keep_last, dist=self.dist)
