"""model.adapter: a saved PEFT adapter (LoRA or OFT) that a run keeps training.

The adapter's shape is fixed by its weights, so its adapter_config.json decides the method
section's shape: method.lora's r, alpha, targets, layers, rsLoRA scale, DoRA and modules
trained in full; method.oft's block size, targets, Cayley parameterisation and modules
trained in full. A config that sets one of them to something else is refused, naming both
values. Dropout and the rest of training are the config's own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from keel.config.schema import LoraConfig, OftConfig, RunConfig

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
    "layers": "layers_to_transform",
}
# the same for method.oft
OFT_SHAPE = {
    "block_size": "oft_block_size",
    "targets": "target_modules",
    "cayley_neumann": "use_cayley_neumann",
    "modules_to_save": "modules_to_save",
}
# PEFT's peft_type -> the method types that keep training it, their section, its shape keys
_KINDS = {"LORA": (("lora", "qlora"), "lora", SHAPE), "OFT": (("oft",), "oft", OFT_SHAPE)}


def with_start_adapter(cfg: RunConfig, raw_method: dict) -> tuple[RunConfig, list[str]]:
    """`cfg` with the method section's shape read from model.adapter's config (unchanged
    without one), and the problems found. `raw_method`: the config's method section as
    written (the keys it sets itself)."""
    folder = cfg.model.adapter
    if folder is None:
        return cfg, []
    where = f"model.adapter = {folder!r}"
    if not cfg.method.uses_adapter:
        return cfg, [
            f"{where} keeps training a LoRA or OFT adapter, but method.type = "
            f"{cfg.method.type}; set method.type lora, qlora or oft (as the adapter), or "
            f"remove model.adapter"
        ]
    path = Path(folder).expanduser()
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / name).is_file()]
    if missing:
        return cfg, [
            f"{where}: no {' or '.join(missing)} there; give a PEFT LoRA or OFT adapter folder "
            f"(a keel run's output.dir, or a checkpoint exported with keel export)"
        ]
    try:
        saved = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return cfg, [f"{where}: cannot read {ADAPTER_CONFIG}: {e}"]
    kind = saved.get("peft_type") if isinstance(saved, dict) else None
    if kind not in _KINDS:
        return cfg, [
            f"{where}: {ADAPTER_CONFIG} is not a LoRA or OFT adapter's (peft_type {kind!r})"
        ]
    types, section, keys = _KINDS[kind]
    if cfg.method.type not in types:
        return cfg, [
            f"{where} is a{'n' if kind == 'OFT' else ''} {kind} adapter, but method.type = "
            f"{cfg.method.type}; set method.type {' or '.join(types)}"
        ]
    shape, problems = _oft_shape(saved, where) if kind == "OFT" else (_lora_shape(saved), [])
    given = raw_method.get(section) if isinstance(raw_method, dict) else None
    given = given if isinstance(given, dict) else {}
    problems += [
        f"method.{section}.{key} = {given[key]!r}, but {where} has {key} {shape[key]!r} (its "
        f"{keys[key]}); remove method.{section}.{key}: the adapter's weights fix it"
        for key in shape
        if key in given and _normal(key, given[key]) != _normal(key, shape[key])
    ]
    if problems:
        return cfg, problems
    settings = dataclasses.replace(getattr(cfg.method, section), **shape)
    return dataclasses.replace(
        cfg, method=dataclasses.replace(cfg.method, **{section: settings})
    ), []


def _lora_shape(saved: dict) -> dict:
    """method.lora's shape keys as the adapter saved them."""
    defaults = LoraConfig()
    return {
        "r": saved.get("r", 8),
        "alpha": float(saved.get("lora_alpha", 8)),
        "targets": _targets(saved),
        "rslora": bool(saved.get("use_rslora", defaults.rslora)),
        "dora": bool(saved.get("use_dora", defaults.dora)),
        "modules_to_save": _distinct(saved.get("modules_to_save") or []),
        "layers": _layers(saved.get("layers_to_transform")),
    }


def _layers(saved) -> list[int]:
    """layers_to_transform as PEFT saves it (null, one index, or a list) as a sorted list."""
    if saved is None:
        return []
    return sorted(saved) if isinstance(saved, list) else [int(saved)]


def _oft_shape(saved: dict, where: str) -> tuple[dict, list[str]]:
    """method.oft's shape keys as the adapter saved them, and what keel cannot continue: a
    rank-given adapter (r blocks per layer, no block size), COFT or shared blocks."""
    problems = []
    if not saved.get("oft_block_size"):
        problems.append(
            f"{where} fixes its blocks per layer (r {saved.get('r')!r}) instead of a block "
            f"size; keel trains OFT by method.oft.block_size only"
        )
    for flag, what in (("coft", "constrained OFT (coft)"), ("block_share", "shared blocks")):
        if saved.get(flag):
            problems.append(f"{where} uses {what}, which keel's OFT does not train")
    shape = {
        "block_size": saved.get("oft_block_size") or 0,
        "targets": _targets(saved),
        "cayley_neumann": bool(saved.get("use_cayley_neumann", OftConfig().cayley_neumann)),
        "modules_to_save": _distinct(saved.get("modules_to_save") or []),
    }
    return shape, problems


def _targets(saved: dict):
    targets = saved.get("target_modules") or []
    return sorted(targets) if isinstance(targets, list | set) else targets


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
