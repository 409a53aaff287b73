"""Rules of the distributed and watchdog sections (how a run executes) beside their field
types; part of keel.config.validate. Returns problems, never raises."""

from __future__ import annotations

from keel.config.schema import RunConfig
from keel.config.sizes import parse_memory
from keel.config.validate_method import positive


def check_distributed(cfg: RunConfig) -> list[str]:
    d = cfg.distributed
    problems = positive(d.timeout_s, "distributed.timeout_s")
    problems += positive(d.preprocess_timeout_s, "distributed.preprocess_timeout_s")
    if d.device_memory != "auto":
        try:
            parse_memory(d.device_memory)
        except ValueError as exc:
            problems.append(f"distributed.device_memory = {exc}, or auto")
    problems += positive(d.fsdp.shard_size, "distributed.fsdp.shard_size", allow_zero=True)
    if d.fsdp.shard_size == 1:
        problems.append(
            "distributed.fsdp.shard_size = 1 shards nothing (a whole copy on every process): "
            "use distributed.strategy ddp, or shard_size 0 (all processes) or 2 and up"
        )
    problems += _check_context_parallel(cfg)
    if d.fsdp.shard_size and d.strategy == "ddp":
        problems.append(
            f"distributed.fsdp.shard_size = {d.fsdp.shard_size} shards within groups of "
            f"processes, and distributed.strategy = ddp shards nothing; use strategy fsdp "
            f"(or auto), or shard_size 0"
        )
    return problems


def _check_context_parallel(cfg: RunConfig) -> list[str]:
    """distributed.context_parallel: what splitting a row's tokens over processes needs."""
    size = cfg.distributed.context_parallel
    if size == 1:
        return []
    key = f"distributed.context_parallel = {size}"
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return [f"{key} must be a whole number of processes >= 1 (1: off)"]
    problems = []
    if not cfg.train.padding_free:
        problems.append(
            f"{key} splits padding-free micro-batches (one row of samples laid end to "
            f"end); set train.padding_free true"
        )
    if cfg.model.attn_implementation in ("eager", "flash_attention_2"):
        problems.append(
            f"{key} splits rows inside keel's varlen attention, which replaces sdpa; "
            f"model.attn_implementation {cfg.model.attn_implementation} is not split: use "
            f"auto or sdpa"
        )
    if cfg.distributed.fsdp.shard_size:
        problems.append(
            f"{key} shards over every process; distributed.fsdp.shard_size "
            f"{cfg.distributed.fsdp.shard_size} (HSDP) cannot be combined with it: set it to 0"
        )
    if cfg.train.router_aux_loss_coef not in (0, 0.0):
        problems.append(
            f"{key}: the routers' balance term (train.router_aux_loss_coef = "
            f"{cfg.train.router_aux_loss_coef}) is over a whole row's tokens, and each "
            f"process holds a part; set it to 0"
        )
    return problems


def check_watchdog(cfg: RunConfig) -> list[str]:
    w = cfg.watchdog
    problems = positive(w.hang_timeout_s, "watchdog.hang_timeout_s")
    problems += positive(w.slow_phase_timeout_s, "watchdog.slow_phase_timeout_s")
    if w.stall_timeout_s != "auto":
        problems += positive(w.stall_timeout_s, "watchdog.stall_timeout_s")
    return problems
