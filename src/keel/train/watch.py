"""The guardrails of a run: the watchdog thread, progress marks in the model, and turning
an out-of-memory error into a message that says what to change.

See keel.distributed.watchdog for what the watchdog detects and reports.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

from keel.config import RunConfig
from keel.distributed.process_group import CollectiveGuard, DistContext, watchdog_store
from keel.distributed.strategy import Strategy
from keel.distributed.watchdog import DIAGNOSTICS, Watchdog, WatchdogSettings
from keel.errors import KeelError, OutOfMemory
from keel.faults import Fault
from keel.models.trainable import decoder_layers
from keel.plan import DoesNotFit, decide, devices_for_run, lighter, plan_run
from keel.precision import Precision
from keel.train.objective import causal_lm_of

RSS_SHARE = 0.95  # of this process's share of the node's RAM, before OOM is declared


class HostOutOfMemory(RuntimeError):
    """RSS went over the limit (CPU): raised in the main thread at its next progress mark."""


def rss_limit(dist: DistContext) -> int | None:
    """On a CPU, the RAM this process may use in a step before keel calls it out of memory."""
    if dist.device.type != "cpu":
        return None  # the GPU raises torch.OutOfMemoryError itself
    return host_rss_limit(dist)


def host_rss_limit(dist: DistContext) -> int:
    """This process's share of the node's RAM (the limit in data preparation, any device)."""
    return int(RSS_SHARE * psutil.virtual_memory().total / max(dist.local_world_size, 1))


@contextmanager
def watching(cfg: RunConfig, dist: DistContext, fault: Fault | None):
    """Run the body under the watchdog (and keel's collectives under its cross-check)."""
    w = cfg.watchdog
    settings = WatchdogSettings(
        hang_timeout_s=w.hang_timeout_s,
        stall_timeout_s=None if w.stall_timeout_s == "auto" else float(w.stall_timeout_s),
        on_stall=w.on_stall,
        diagnostics_dir=Path(cfg.output.dir).expanduser() / DIAGNOSTICS,
        rss_limit_bytes=rss_limit(dist),
        host_rss_limit_bytes=host_rss_limit(dist),
    )
    store = watchdog_store(dist, w.hang_timeout_s) if dist.distributed and w.enabled else None
    watchdog = Watchdog(settings, rank=dist.rank, world_size=dist.world_size, store=store)

    def alarm_in_main_thread() -> None:
        if watchdog.rss_exceeded is not None:
            rss, limit = watchdog.rss_exceeded
            watchdog.rss_exceeded = None
            raise HostOutOfMemory(
                f"resident memory {rss / 2**30:.2f} GiB is over this "
                f"process's limit of {limit / 2**30:.2f} GiB"
            )

    watchdog.progress.alarm = alarm_in_main_thread
    if store is not None and dist.store is not None:
        from torch.distributed import PrefixStore

        dist.guard = CollectiveGuard(
            rank=dist.rank,
            world_size=dist.world_size,
            store=PrefixStore("watchdog", dist.store),
            watchdog=watchdog,
            fault=fault,
            slow_limit_s=cfg.distributed.preprocess_timeout_s,
        )
    if w.enabled:
        watchdog.start()
    try:
        yield watchdog
    finally:
        watchdog.stop()
        dist.guard = None


def instrument(model: nn.Module, watchdog: Watchdog, fault: Fault | None, rank: int) -> None:
    """Progress marks at every decoder layer's forward (cheap: a few attribute stores), and
    the out-of-memory and NaN test faults in the forward pass."""
    progress = watchdog.progress
    lm = causal_lm_of(model)
    for index, layer in enumerate(decoder_layers(lm)):
        layer.register_forward_pre_hook(
            lambda _module, _args, index=index: progress.mark(("layer", index, "forward"))
        )
    if fault is not None and fault.kind == "oom":

        def raise_oom(_module, _args):
            if fault.due("oom", progress.step, rank):
                raise torch.OutOfMemoryError("KEEL_FAULT: out of memory (injected)")

        # The decoder runs in every forward keel makes (fast head or full forward).
        lm.get_decoder().register_forward_pre_hook(raise_oom)
    if fault is not None and fault.kind == "nan":

        def poison(_module, _args, output):
            if fault.due("nan", progress.step, rank):
                return output * float("nan")
            return output

        lm.get_input_embeddings().register_forward_hook(poison)


@dataclass(frozen=True)
class PlannedRun:
    """What the memory plan decided for this run (the same on every rank)."""

    strategy: Strategy | None  # None: no plan could be made
    lighter: list[str]  # changes that need less memory, each with its estimate


def plan_memory(
    cfg: RunConfig,
    model_dir: Path,
    dist: DistContext,
    precision: Precision,
    log,
    longest_prompt: int | None = None,
) -> PlannedRun:
    """Plan the run's memory before any weight is loaded (keel.plan): the strategy to use,
    or a refusal (exit 2) when it does not fit and distributed.plan is enforce.
    `longest_prompt`: a prompt stage's longest prepared prompt (grpo's rows are that and a
    completion, not data.cutoff_len)."""
    devices = devices_for_run(
        dist.device.type,
        world_size=dist.world_size,
        local_world_size=dist.local_world_size,
        device_memory=cfg.distributed.device_memory,
    )
    try:
        plan = plan_run(
            cfg, model_dir, devices=devices, precision=precision, longest_prompt=longest_prompt
        )
    except KeelError:
        raise
    except Exception as exc:  # an architecture the estimator cannot read: train anyway
        log(
            f"plan: no memory plan for this model ({type(exc).__name__}: {exc}); the "
            f"strategy follows the size of a replica instead"
        )
        return PlannedRun(strategy=None, lighter=[])
    decision = decide(plan)
    if not decision.fits:
        if cfg.distributed.plan == "enforce":
            raise DoesNotFit(decision.message)
        log(f"warning: {decision.message} (distributed.plan=warn: training anyway)")
    else:
        log(decision.message)
    return PlannedRun(strategy=decision.strategy, lighter=lighter(plan, decision.option))


def out_of_memory(
    exc: BaseException,
    *,
    step: int,
    rank: int,
    rows: list[dict],
    cfg: RunConfig,
    checkpoint: Path | None,
    lighter: list[str] = (),
) -> OutOfMemory:
    """The user-facing error for an out-of-memory step: what ran, and what to change."""
    longest = max((len(r["input_ids"]) for r in rows), default=0)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    resume = (
        f"the newest complete checkpoint, {checkpoint}, is intact: run the same command "
        f"to resume from it"
        if checkpoint
        else "no checkpoint was written yet (output.save_every)"
    )
    return OutOfMemory(
        f"out of memory in step {step} on rank {rank}, in a micro-batch of {len(rows)} "
        f"row(s), the longest {longest} tokens (train.micro_batch_size="
        f"{cfg.train.micro_batch_size}, data.cutoff_len={cfg.data.cutoff_len}): "
        f"{first_line}.\n{_what_to_change(cfg, lighter)}\n{resume}"
    )


def _what_to_change(cfg: RunConfig, lighter: list[str]) -> str:
    if lighter:  # the planner's estimates: it judged this run to fit, so it was low
        listed = "\n".join(f"  {change}" for change in lighter)
        return f"changes that need less memory (keel plan's estimates):\n{listed}"
    return suggest_smaller(cfg)


def suggest_smaller(cfg: RunConfig) -> str:
    """What lowers a step's memory, most effective first, given what is already on."""
    t = cfg.train
    options = []
    if t.micro_batch_size > 1:
        options.append(
            f"train.micro_batch_size={max(1, t.micro_batch_size // 2)} (the "
            f"global batch stays the same with train.global_batch_size set)"
        )
    if not t.gradient_checkpointing:
        options.append("train.gradient_checkpointing=true")
    options.append(f"data.cutoff_len={max(8, cfg.data.cutoff_len // 2)}")
    if cfg.method.type == "full":
        options.append("method.type=lora")
    return "try: " + "; or ".join(options) + " (keel plan CONFIG shows each option's memory)"
