"""The user-facing results of a run: model (PEFT adapter or HF model), plot and summary.

Written once, by rank 0, from gathered state: under FSDP the shards are gathered to full
CPU tensors first, so the output is an ordinary directory any tool loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from keel import __version__
from keel.checkpoint.layout import clear_partial_checkpoints
from keel.config import RunConfig
from keel.distributed.full_state import gather_full_state
from keel.distributed.parallelize import full_value, unwrap
from keel.distributed.process_group import DistContext
from keel.errors import KeelError
from keel.files import fsync_tree
from keel.models import load_for_inference, save_model_dir
from keel.models.model_card import ModelCard, write_model_card
from keel.models.sequence_classifier import save_sequence_classifier
from keel.precision import Precision
from keel.stages.registry import get_stage
from keel.train.metrics import METRICS_FILE, RunStats, peak_rss_mb, plot_losses
from keel.train.output_folder import (
    FINAL_SUMMARY,
    check_ownership,
    has_run_files,
    record_written,
    remove_run_files,
)

FINAL_MARKER = FINAL_SUMMARY


def write_final_outputs(
    cfg: RunConfig,
    out: Path,
    built,
    tokenizer,
    model_dir: Path,
    dist: DistContext,
    log,
    *,
    steps: int,
    stats: RunStats,
    precision: Precision,
) -> dict:
    """Write the final model atomically (file by file), the loss plot and keel_run.json."""
    full_state = None
    if built.strategy.shards:
        full_state = gather_full_state(built.model, trainable_only=cfg.method.uses_adapter)
    score = _score_head(cfg, built)
    summary = {**_summary(steps, stats, precision, dist), "strategy": built.strategy.value}
    if dist.is_main:
        tmp = out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        if score is None:
            _save_model(cfg, built.model, tokenizer, model_dir, tmp, full_state, log)
        else:
            _save_reward_model(cfg, built.model, tokenizer, model_dir, tmp, full_state, score, log)
        _write_cards(cfg, tmp, out, steps, stats.final_loss)
        fsync_tree(tmp)
        record_written(out, [entry.name for entry in tmp.iterdir()])  # before they move in
        for entry in tmp.iterdir():
            target = out / entry.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(entry, target)
        tmp.rmdir()
        plot_losses(out / METRICS_FILE, out / "loss.png")
        (out / FINAL_MARKER).write_text(json.dumps(summary, indent=2))
        log(
            f"done: {steps} steps, {summary['real_tokens']} tokens in "
            f"{summary['train_seconds']:.1f}s ({summary['tokens_per_s']} tokens/s), final loss "
            f"{_loss(stats.final_loss)}, peak RSS {summary['peak_rss_mb']:.0f} MB (max over processes) "
            f"-> {out}"
        )
    dist.barrier()
    return summary


def _loss(value: float | None) -> str:
    # 4 decimals for people; metrics.jsonl and keel_run.json keep the full value
    return "none" if value is None else f"{value:.4f}"


def _write_cards(cfg: RunConfig, tmp: Path, out: Path, steps: int, loss: float | None) -> None:
    """README.md model cards for the model (or adapter) and the merged copy, if any."""
    card = ModelCard(
        base_model=cfg.model.path,
        # a reward model's folder holds the merged model, whatever the method
        adapter=cfg.method.uses_adapter and get_stage(cfg.train.stage).head != "score",
        method=cfg.method.type,
        stage=cfg.train.stage,
        datasets=tuple(d.path for d in cfg.data.datasets),
        steps=steps,
        final_loss=loss,
    )
    write_model_card(tmp, card, shown_as=out)
    if (tmp / "merged").is_dir():
        merged = replace(card, adapter=False, extra=(("merged", "the adapter, into its base"),))
        write_model_card(tmp / "merged", merged, shown_as=out / "merged")


def _score_head(cfg: RunConfig, built) -> torch.Tensor | None:
    """A reward model's trained score head [1, hidden], whole (a collective under FSDP:
    every rank calls it); None for a stage whose objective has no score head."""
    if get_stage(cfg.train.stage).head != "score":
        return None
    return full_value(unwrap(built.objective).score.weight).detach().cpu()


def _save_reward_model(
    cfg: RunConfig, model, tokenizer, model_dir: Path, tmp: Path, full_state, score, log
) -> None:
    """rm: the output folder is a *ForSequenceClassification model, the backbone (with a
    LoRA merged into its base) and the trained head; the causal LM it is built from is
    written first, inside `tmp`, and removed."""
    causal_lm = tmp / "causal_lm"
    # only an adapter merges (as validation allows merge_lora only with one): a sharded full
    # model asked to merge would look for an adapter in its own folder
    merging = replace(cfg, output=replace(cfg.output, merge_lora=cfg.method.uses_adapter))
    _save_model(merging, model, tokenizer, model_dir, causal_lm, full_state, log)
    merged = causal_lm / "merged"
    save_sequence_classifier(merged if merged.is_dir() else causal_lm, score, tokenizer, tmp)
    shutil.rmtree(causal_lm)
    log(f"reward model: {type(model).__name__} backbone + score head, as a sequence classifier")


def _save_model(
    cfg: RunConfig, model, tokenizer, model_dir: Path, tmp: Path, full_state: dict | None, log
) -> None:
    # One process or DDP: the live module holds full tensors, and a LoRA merges in a copy.
    # A QLoRA base is NF4: the adapter merges into the full-precision base instead.
    merge_live = full_state is None and cfg.method.type != "qlora"
    save_model_dir(model, tokenizer, tmp, state_dict=full_state)
    if cfg.output.merge_lora and merge_live:
        save_model_dir(model, tokenizer, tmp / "merged", merged=True)
    elif cfg.output.merge_lora:
        # A sharded or quantised live model cannot be merged in place: rebuild base +
        # adapter on CPU, in the base's own precision.
        rebuilt, _ = load_for_inference(
            str(model_dir), str(tmp), cache_dir=cfg.model.cache_dir, log=log
        )
        save_model_dir(rebuilt.merge_and_unload(), tokenizer, tmp / "merged")


def _summary(steps: int, stats: RunStats, precision: Precision, dist: DistContext) -> dict:
    seconds = stats.train_seconds
    # Per process: memory is the point of sharding, and the maximum alone hides imbalance.
    per_rank = dist.gather_objects(
        {
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "load_peak_rss_mb": round(stats.load_peak_rss_mb, 1),
            "rows": stats.rows,
            "filler_micro_batches": stats.filler_micro_batches,
        }
    )
    peak = max(r["peak_rss_mb"] for r in per_rank)
    return {
        "steps": steps,
        "final_loss": stats.final_loss,
        "precision": precision.name,
        "processes": dist.world_size,
        "real_tokens": stats.real_tokens,
        "target_tokens": stats.target_tokens,
        "train_seconds": round(seconds, 2),
        "tokens_per_s": round(stats.real_tokens / seconds, 1) if seconds else None,
        "peak_rss_mb": round(peak, 1),
        "per_rank": per_rank,
        "keel_version": __version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def prepare_output_dir(
    cfg: RunConfig, out: Path, resume_from: Path | None, log=print
) -> list[Path]:
    """Make `out` ready for this run (refusing a non-empty one that is not this run's, and
    any folder holding files keel did not write); returns the leftovers of interrupted
    checkpoint saves it removed. output.overwrite removes keel's files only, logging each."""
    out.mkdir(parents=True, exist_ok=True)
    check_ownership(out, log)  # claimed at the run's start; again for direct callers
    if has_run_files(out) and resume_from is None:
        # An interrupted keel run that never completed a checkpoint has nothing to lose:
        # with resume=auto it starts over. Anything else needs an explicit overwrite.
        unfinished_run = (out / "config.yaml").is_file() and not (out / FINAL_MARKER).exists()
        if unfinished_run and cfg.train.resume == "auto":
            return clear_partial_checkpoints(out)
        if not cfg.output.overwrite:
            raise KeelError(
                f"output.dir {out} is not empty and there is no checkpoint to resume from; "
                f"choose another output.dir, or set output.overwrite=true to replace it"
            )
        remove_run_files(out, log)
    return clear_partial_checkpoints(out)
