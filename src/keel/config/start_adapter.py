"""model.adapter: a saved PEFT LoRA adapter that a run keeps training.

The adapter's shape is fixed by its weights, so its adapter_config.json decides
method.lora's r, alpha, targets, rsLoRA scale, DoRA and modules trained in full; a config that
sets one of them to something else is refused, naming both values. Dropout and the rest of
training are the config's own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from keel.config.schema import LoraConfig, RunConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# method.lora key -> what adapter_config.json calls it (the keys a saved adapter fixes)
SHAPE = {
    "r": "r",
    "alpha": "lora_alpha",
    "targets": "target_modules",
    "rslora": "use_rslora",
    "dora": "use_dora",
    "modules_to_save": "modules_to_save",
}


def with_start_adapter(cfg: RunConfig, given: dict) -> tuple[RunConfig, list[str]]:
    """`cfg` with method.lora's shape read from model.adapter's config (unchanged without
    one), and the problems found. `given`: the method.lora keys the config sets itself."""
    folder = cfg.model.adapter
    if folder is None:
        return cfg, []
    where = f"model.adapter = {folder!r}"
    if not cfg.method.uses_lora:
        return cfg, [
            f"{where} keeps training a LoRA adapter, but method.type = {cfg.method.type}; "
            f"set method.type lora (or qlora), or remove model.adapter"
        ]
    path = Path(folder).expanduser()
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / name).is_file()]
    if missing:
        return cfg, [
            f"{where}: no {' or '.join(missing)} there; give a PEFT LoRA adapter folder (a keel "
            f"LoRA run's output.dir, or a checkpoint exported with keel export)"
        ]
    try:
        saved = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return cfg, [f"{where}: cannot read {ADAPTER_CONFIG}: {e}"]
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        kind = saved.get("peft_type") if isinstance(saved, dict) else None
        return cfg, [f"{where}: {ADAPTER_CONFIG} is not a LoRA adapter's (peft_type {kind!r})"]
    shape = _shape_of(saved)
    problems = [
        f"method.lora.{key} = {given[key]!r}, but {where} has {key} {shape[key]!r} (its "
        f"{SHAPE[key]}); remove method.lora.{key}: the adapter's weights fix it"
        for key in shape
        if key in given and _normal(key, given[key]) != _normal(key, shape[key])
    ]
    if problems:
        return cfg, problems
    lora = dataclasses.replace(cfg.method.lora, **shape)
    return dataclasses.replace(cfg, method=dataclasses.replace(cfg.method, lora=lora)), []


def _shape_of(saved: dict) -> dict:
    """method.lora's shape keys as the adapter saved them."""
    targets = saved.get("target_modules") or []
    defaults = LoraConfig()
    return {
        "r": saved.get("r", 8),
        "alpha": float(saved.get("lora_alpha", 8)),
        "targets": sorted(targets) if isinstance(targets, list | set) else targets,
        "rslora": bool(saved.get("use_rslora", defaults.rslora)),
        "dora": bool(saved.get("use_dora", defaults.dora)),
        "modules_to_save": _distinct(saved.get("modules_to_save") or []),
    }


def _distinct(names: list[str]) -> list[str]:
    """Module names without those another one names already (PEFT records a tied module as
    both embed_tokens and model.embed_tokens; a name matches its dotted suffixes)."""
    names = sorted(set(names))
    return [n for n in names if not any(n != m and n.endswith("." + m) for m in names)]


def _normal(key: str, value):
    if key in ("targets", "modules_to_save") and isinstance(value, list):
        return sorted(set(value))
    if key == "alpha":
        return float(value)
    return value
