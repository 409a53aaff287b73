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
    problems += _check_tensor_parallel(cfg)
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


def _check_tensor_parallel(cfg: RunConfig) -> list[str]:
    """distributed.tensor_parallel: what splitting each decoder layer over processes runs
    with (keel.distributed.tensor_parallel; the model's own checks come with the model)."""
    size = cfg.distributed.tensor_parallel
    if size == 1:
        return []
    key = f"distributed.tensor_parallel = {size}"
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return [f"{key} must be a whole number of processes >= 1 (1: off)"]
    d, method, problems = cfg.distributed, cfg.method, []
    if d.context_parallel > 1:
        problems.append(
            f"{key} with distributed.context_parallel = {d.context_parallel}: keel splits a "
            f"layer's heads or a row's tokens, not both; set one of them to 1"
        )
    if d.strategy == "ddp":
        problems.append(
            f"{key} runs under FSDP2 (the layers' split weights sharded over the data-parallel "
            f"processes); distributed.strategy ddp keeps whole copies: use fsdp or auto"
        )
    unsplit = {
        "qlora": "a 4-bit NF4 base (QLoRA) is quantised in blocks keel does not split: use "
        "method.type lora",
        "oft": "OFT's rotations are not split: use method.type lora",
    }
    if method.type in unsplit:
        problems.append(f"{key} with method.type {method.type}: {unsplit[method.type]}")
    if method.uses_lora and method.lora.dora:
        problems.append(
            f"{key} with method.lora.dora: DoRA's magnitudes need the whole weight's norms; "
            f"turn one of them off"
        )
    if method.uses_lora and method.lora.init in ("pissa", "olora"):
        problems.append(
            f"{key} with method.lora.init {method.lora.init}: the decomposition needs each "
            f"whole weight; use init default or gaussian"
        )
    if method.qat.scheme != "none":
        problems.append(
            f"{key} with method.qat.scheme {method.qat.scheme}: the fake-quantised layers "
            f"are not split; set one of them off"
        )
    return problems


def check_watchdog(cfg: RunConfig) -> list[str]:
    w = cfg.watchdog
    problems = positive(w.hang_timeout_s, "watchdog.hang_timeout_s")
    problems += positive(w.slow_phase_timeout_s, "watchdog.slow_phase_timeout_s")
    if w.stall_timeout_s != "auto":
        problems += positive(w.stall_timeout_s, "watchdog.stall_timeout_s")
    return problems
