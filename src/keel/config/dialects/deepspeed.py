"""A DeepSpeed JSON as keel's distributed settings: ZeRO-3 shards everything (FSDP2),
ZeRO-2/1/0 keep a full replica per process (DDP); CPU offload of ZeRO-3 is FSDP2's; AutoTP
(`tensor_parallel.autotp_size`) is keel's tensor parallelism, which runs under FSDP2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from keel.config.dialects.report import KeyFate, unknown_key

if TYPE_CHECKING:
    from keel.config.dialects.build import Build

_AUTO = "auto: the trainer fills it from the YAML's own keys, which keel maps"
_TUNING = "DeepSpeed's communication tuning; keel's DDP and FSDP2 choose their own buckets"
_DIAGNOSTICS = (
    "DeepSpeed's own timing and logging; keel logs the loss, step time and throughput to "
    "metrics.jsonl (and output.loggers)"
)
_SAVE_16BIT = "keel always saves the full model in Hugging Face format"
_IGNORED = {
    "train_batch_size": _AUTO,
    "train_micro_batch_size_per_gpu": _AUTO,
    "gradient_accumulation_steps": _AUTO,
    "zero_allow_untested_optimizer": "keel builds its own optimizer (train.optimizer)",
    "zero_force_ds_cpu_optimizer": "keel builds its own optimizer (train.optimizer)",
    "compile": "DeepSpeed's torch.compile of the model, a speed setting: keel runs the model "
    "uncompiled (the same results)",
    "wall_clock_breakdown": _DIAGNOSTICS,
    "steps_per_print": _DIAGNOSTICS,
    "comms_config": _DIAGNOSTICS,
    "monitor_config": _DIAGNOSTICS,
    "flops_profiler": _DIAGNOSTICS,
    "bf16": "precision comes from the YAML's bf16/fp16 keys (train.precision)",
    "fp16": "precision comes from the YAML's bf16/fp16 keys (train.precision); keel's fp16 "
    "uses dynamic loss scaling",
    "zero_optimization.allgather_partitions": _TUNING,
    "zero_optimization.allgather_bucket_size": _TUNING,
    "zero_optimization.overlap_comm": _TUNING,
    "zero_optimization.reduce_scatter": _TUNING,
    "zero_optimization.reduce_bucket_size": _TUNING,
    "zero_optimization.contiguous_gradients": _TUNING,
    "zero_optimization.round_robin_gradients": _TUNING,
    "zero_optimization.sub_group_size": _TUNING,
    "zero_optimization.stage3_prefetch_bucket_size": _TUNING,
    "zero_optimization.stage3_param_persistence_threshold": _TUNING,
    "zero_optimization.stage3_max_live_parameters": _TUNING,
    "zero_optimization.stage3_max_reuse_distance": _TUNING,
    # the same four without their stage3_ prefix, as Axolotl's deepspeed_configs spell them
    "zero_optimization.prefetch_bucket_size": _TUNING,
    "zero_optimization.param_persistence_threshold": _TUNING,
    "zero_optimization.max_live_parameters": _TUNING,
    "zero_optimization.max_reuse_distance": _TUNING,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _SAVE_16BIT,
    "zero_optimization.gather_16bit_weights_on_model_save": _SAVE_16BIT,
}
_KNOWN = (
    *_IGNORED,
    "gradient_clipping",
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "tensor_parallel.autotp_size",
)


def apply_deepspeed(build: Build, key: str, value) -> None:
    """Their `key: value` (a DeepSpeed JSON's path, or the JSON as a mapping) as keel's
    distributed settings, with a fate for `key` and for every key of the JSON."""
    if value is None:
        build.ignored(key, "empty: no DeepSpeed")
        return
    settings, fates = read_deepspeed(value, build.source, key)
    for dotted, setting in settings.items():
        build.set(dotted, setting)
    if settings:
        build.mapped(key, ", ".join(settings), "from the JSON: its keys follow")
    build.fates.extend(fates)


def read_deepspeed(value, source: Path, key: str) -> tuple[dict, list[KeyFate]]:
    """(keel settings as {dotted keel key: value}, the fate of `key` and of every key in the
    JSON, dotted under `key`). `value` is their path (relative to the working directory, as
    the HF Trainer reads it, else to the folder of `source`) or the JSON as a mapping."""
    config, problem = _load(value, source)
    if problem:
        return {}, [KeyFate(key, "refused", why=problem)]
    settings: dict = {}
    fates = [_zero_stage(config, settings, key)]
    for name, item in _flatten(config):
        if name in ("zero_optimization.stage", "zero_optimization"):
            continue
        fates.append(_one_key(name, item, config, settings, key))
    if settings.get("distributed.tensor_parallel", 1) > 1 and fates[0].fate == "mapped":
        fates[0] = _zero_beside_autotp(config, settings, fates[0])
    return settings, fates


def _zero_beside_autotp(config: dict, settings: dict, fate: KeyFate) -> KeyFate:
    """ZeRO-0/1/2 beside AutoTP: keel's tensor parallelism runs under FSDP2 only."""
    if settings["distributed.strategy"] == "fsdp":  # ZeRO-3 already
        return fate
    settings["distributed.strategy"] = "fsdp"
    stage = config["zero_optimization"].get("stage", 0)
    why = (
        f"ZeRO-{stage} beside AutoTP: keel's tensor parallelism runs under FSDP2, which "
        f"shards the split layers and the rest over the groups (more than ZeRO-{stage} "
        "shards; the same math)"
    )
    return KeyFate(fate.key, "mapped", "distributed.strategy", why)


def _load(value, source: Path) -> tuple[dict, str]:
    if isinstance(value, dict):
        return value, ""
    if not isinstance(value, str):
        return {}, f"{value!r} must be the path to a DeepSpeed JSON file"
    tried = [Path(value)] if Path(value).is_absolute() else [Path(value), source.parent / value]
    found = next((path for path in tried if path.is_file()), None)
    if found is None:
        where = " or ".join(str(path) for path in tried)
        return {}, f"the DeepSpeed config {value} is not at {where}"
    try:
        loaded = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"{found} is not a readable JSON file ({exc})"
    if not isinstance(loaded, dict):
        return {}, f"{found} must hold a JSON object"
    return loaded, ""


def _zero_stage(config: dict, settings: dict, key: str) -> KeyFate:
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    name = f"{key}.zero_optimization.stage"
    if stage == 3:
        settings["distributed.strategy"] = "fsdp"
        why = "ZeRO-3 shards parameters, gradients and optimizer state: FSDP2 does the same"
        return KeyFate(name, "mapped", "distributed.strategy", why)
    if stage in (0, 1, 2):
        settings["distributed.strategy"] = "ddp"
        why = (
            f"ZeRO-{stage} keeps a full copy of the weights on every process, as DDP does "
            "(keel's DDP does not shard the optimizer state; `keel plan` shows the memory)"
        )
        return KeyFate(name, "mapped", "distributed.strategy", why)
    return KeyFate(name, "refused", why=f"ZeRO stage {stage!r} is not 0, 1, 2 or 3")


def _one_key(name: str, item, config: dict, settings: dict, key: str) -> KeyFate:
    dotted = f"{key}.{name}"
    if name in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
        return _offload(dotted, item, config, settings)
    if name == "tensor_parallel.autotp_size":
        return _autotp(dotted, item, settings)
    if name == "gradient_clipping":
        if item == "auto":
            return KeyFate(dotted, "ignored", why=_AUTO)
        settings["train.max_grad_norm"] = item
        return KeyFate(dotted, "mapped", "train.max_grad_norm")
    top = name.split(".")[0]
    if top.startswith("_"):  # "_comment" in LLaMA-Factory's ds_z2_autotp_config.json
        return KeyFate(dotted, "ignored", why="a comment: DeepSpeed reads no key of that name")
    why = _IGNORED.get(name) or _IGNORED.get(top)
    if why:
        return KeyFate(dotted, "ignored", why=why)
    why = "a DeepSpeed setting keel has no counterpart for; remove it from the JSON"
    return KeyFate(dotted, "refused", why=unknown_key(name, _KNOWN, why))


def _autotp(dotted: str, item, settings: dict) -> KeyFate:
    """AutoTP's group size: keel's distributed.tensor_parallel (transformers' plan for the
    model, where AutoTP finds the linear layers itself: the same split)."""
    if item in (0, 1):
        return KeyFate(dotted, "ignored", why=f"{item}: no tensor parallelism")
    if not isinstance(item, int) or isinstance(item, bool) or item < 0:
        return KeyFate(dotted, "refused", why=f"{item!r}: the processes that split a layer")
    settings["distributed.tensor_parallel"] = item
    why = f"each decoder layer's heads and MLP columns split over {item} processes"
    return KeyFate(dotted, "mapped", "distributed.tensor_parallel", why)


def _offload(dotted: str, item, config: dict, settings: dict) -> KeyFate:
    device = item.get("device", "none") if isinstance(item, dict) else "none"
    if device == "none":
        return KeyFate(dotted, "ignored", why="device none: nothing is offloaded")
    if device != "cpu":
        return KeyFate(dotted, "refused", why=f"offload to {device}: keel offloads to CPU only")
    if config.get("zero_optimization", {}).get("stage") == 3:
        settings["distributed.fsdp.cpu_offload"] = True
        why = "FSDP2's CPU offload keeps parameters, gradients and optimizer state in CPU memory"
        return KeyFate(dotted, "mapped", "distributed.fsdp.cpu_offload", why)
    why = (
        "keel's DDP keeps the optimizer on the device; CPU offload needs ZeRO-3 "
        "(distributed.strategy fsdp with distributed.fsdp.cpu_offload)"
    )
    return KeyFate(dotted, "ignored", why=why)


def _flatten(config: dict, prefix: str = ""):
    """(dotted name, value) of every leaf, except that offload blocks and the bf16/fp16
    blocks count as one key each."""
    for name, value in config.items():
        dotted = f"{prefix}{name}"
        whole = dotted in ("bf16", "fp16") or dotted.startswith("zero_optimization.offload_")
        if isinstance(value, dict) and value and not whole:
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value
