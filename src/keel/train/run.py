"""`keel train`: preflight everything, then set up, loop, checkpoint and write the outputs.

Order matters: the config, the model path and the whole dataset are validated before the
output folder is touched, so bad input never leaves a half-written output directory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from keel import __version__
from keel.config import RunConfig, config_to_dict
from keel.data import PreparedData, prepare_data
from keel.errors import CheckpointError, KeelError
from keel.models import (
    apply_method,
    load_model,
    load_tokenizer,
    resolve_model_path,
    save_model_dir,
    torch_dtype,
)
from keel.train import checkpoint as ckpt
from keel.train.loop import StepCallback, StepPlan, Trainer
from keel.train.metrics import (
    METRICS_FILE,
    MetricsLog,
    Progress,
    memory_now,
    peak_rss_mb,
    plot_losses,
)
from keel.train.objective import CausalLMObjective
from keel.train.optim import build_optimizer, build_scheduler
from keel.train.precision import resolve_precision

FINAL_MARKER = "keel_run.json"


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float]  # per-step training loss of the steps this process ran
    summary: dict


def run_training(cfg: RunConfig, *, base_dir: Path | None = None,
                 log: Callable[[str], None] = print,
                 on_step_end: StepCallback | None = None) -> RunResult:
    """Train as `cfg` says. Raises KeelError subclasses for anything the user can fix."""
    base_dir = base_dir or Path.cwd()
    _set_threads(cfg.train.threads, log)
    torch.manual_seed(cfg.train.seed)
    out = Path(cfg.output.dir).expanduser()
    model_dir, tokenizer, data = preflight(cfg, base_dir=base_dir, log=log)
    resume_from = _resume_point(cfg, out, data.fingerprint)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(cfg.train.precision, device)
    log(f"precision: {precision.name} ({precision.reason})")

    model = _build_model(cfg, model_dir, device, log)
    plan = StepPlan(num_rows=len(data.train), micro_batch_size=cfg.train.micro_batch_size,
                    grad_accum=cfg.train.grad_accum, seed=cfg.train.seed,
                    shuffle=cfg.data.shuffle)
    total_steps = plan.total_steps(cfg.train.epochs, cfg.train.max_steps)
    objective = CausalLMObjective(model, chunk_size=cfg.train.loss_chunk_size).to(device)
    optimizer = build_optimizer(objective, cfg.train)
    trainer = Trainer(objective=objective, optimizer=optimizer,
                      scheduler=build_scheduler(optimizer, cfg.train, total_steps),
                      precision=precision, device=device, pad_id=tokenizer.pad_token_id,
                      max_grad_norm=cfg.train.max_grad_norm)
    start_step = _restore(trainer, model, resume_from, log) if resume_from else 0

    for partial in _prepare_output_dir(cfg, out, resume_from):
        log(f"removed an interrupted checkpoint save: {partial}")
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    log(f"training: {len(data.train)} rows, {plan.steps_per_epoch} steps/epoch, "
        f"{total_steps} steps, starting at step {start_step}")
    loop = _Loop(cfg, out, trainer, plan, data, tokenizer, log, on_step_end)
    losses, stats = loop.run(start_step, total_steps, data.fingerprint)
    summary = _finish(cfg, out, model, tokenizer, total_steps, stats, precision.name, log)
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


def _set_threads(requested: int, log) -> None:
    # torchrun sets OMP_NUM_THREADS=1 unless told otherwise; choose deliberately instead.
    threads = requested or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    log(f"threads: {threads}")


def _build_model(cfg: RunConfig, model_dir: Path, device: torch.device, log):
    dtype = torch_dtype(cfg.model.dtype) or torch.float32  # auto: fp32 master weights
    model = load_model(model_dir, dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # use_cache stays as saved: the objective passes use_cache=False per call, and writing
    # False into config.json would slow generation for every tool that loads our output.
    return apply_method(model, cfg.method, log=log).to(device)


def _resume_point(cfg: RunConfig, out: Path, data_fingerprint: str) -> Path | None:
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


def _restore(trainer: Trainer, model, checkpoint: Path, log) -> int:
    state = ckpt.load_train_state(checkpoint)
    ckpt.load_trained_weights(model, checkpoint)
    trainer.optimizer.load_state_dict(state.optimizer)
    trainer.scheduler.load_state_dict(state.scheduler)
    ckpt.restore_rng(state.rng)
    log(f"resumed from {checkpoint} at step {state.step}")
    return state.step


class _Loop:
    """Steps, logging, evaluation and periodic checkpoints for one run."""

    def __init__(self, cfg: RunConfig, out: Path, trainer: Trainer, plan: StepPlan,
                 data: PreparedData, tokenizer, log, on_step_end):
        self.cfg, self.out, self.trainer, self.plan = cfg, out, trainer, plan
        self.data, self.tokenizer, self.log, self.on_step_end = data, tokenizer, log, on_step_end
        # Materialised once: the eval split does not change during a run.
        self.eval_rows = [data.eval[i] for i in range(len(data.eval))] if data.eval else []

    def run(self, start: int, total: int, fingerprint: str) -> tuple[list[float], dict]:
        out_cfg = self.cfg.output
        metrics = MetricsLog(self.out, resume_step=start,
                             tensorboard="tensorboard" in out_cfg.loggers)
        progress = Progress(total=total, initial=start)
        losses: list[float] = []
        stats = {"real_tokens": 0, "target_tokens": 0, "train_seconds": 0.0, "loss": None}
        window = {"real": 0, "seconds": 0.0}
        try:
            for step in range(start, total):
                rows = [[self.data.train[i] for i in mb] for mb in self.plan.window(step)]
                result = self.trainer.train_step(rows)
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
                    metrics.write(record)
                self._maybe_eval(done, total, metrics, progress)
                if (out_cfg.save_every and done % out_cfg.save_every == 0) or done == total:
                    self._save(done, fingerprint)
                if self.on_step_end is not None:
                    self.on_step_end(done, record or {"step": done, "loss": result.loss})
        finally:
            progress.close()
            metrics.close()
        return losses, stats

    def _maybe_eval(self, done: int, total: int, metrics: MetricsLog, progress: Progress):
        if not self.eval_rows:
            return
        every = self.cfg.train.eval_every
        if (every and done % every == 0) or done == total:
            result = self.trainer.evaluate(self.eval_rows, self.cfg.train.micro_batch_size)
            metrics.write({"step": done, **result})
            progress.write(f"step {done}: eval_loss {result['eval_loss']:.4f} "
                           f"ppl {result['eval_ppl']:.2f}")

    def _save(self, step: int, fingerprint: str) -> None:
        model = self.trainer.objective.model
        state = ckpt.TrainState(step=step, optimizer=self.trainer.optimizer.state_dict(),
                                scheduler=self.trainer.scheduler.state_dict(),
                                rng=ckpt.capture_rng())
        ckpt.save_checkpoint(self.out, state,
                             lambda d: save_model_dir(model, self.tokenizer, d),
                             {"data_fingerprint": fingerprint, "keel_version": __version__},
                             keep_last=self.cfg.output.keep_last)


def _finish(cfg: RunConfig, out: Path, model, tokenizer, steps: int, stats: dict,
            precision: str, log) -> dict:
    """Write the user-facing model (atomically, file by file), plot and summary."""
    tmp = out / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(model, tokenizer, tmp)
    if cfg.output.merge_lora:
        save_model_dir(model, tokenizer, tmp / "merged", merged=True)
    ckpt.fsync_tree(tmp)
    for entry in tmp.iterdir():
        target = out / entry.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)
    tmp.rmdir()
    plot_losses(out / METRICS_FILE, out / "loss.png")
    seconds = stats["train_seconds"]
    summary = {"steps": steps, "final_loss": stats["loss"], "precision": precision,
               "real_tokens": stats["real_tokens"], "target_tokens": stats["target_tokens"],
               "train_seconds": round(seconds, 2),
               "tokens_per_s": round(stats["real_tokens"] / seconds, 1) if seconds else None,
               "peak_rss_mb": round(peak_rss_mb(), 1), "keel_version": __version__,
               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (out / FINAL_MARKER).write_text(json.dumps(summary, indent=2))
    log(f"done: {steps} steps, {summary['real_tokens']} tokens in {seconds:.1f}s "
        f"({summary['tokens_per_s']} tokens/s), final loss {stats['loss']}, "
        f"peak RSS {summary['peak_rss_mb']:.0f} MB -> {out}")
    return summary
