"""Keys that let transformers 4.x, and tools pinned to it (older vLLM, TGI), read a model
folder written by transformers 5.

transformers 5 writes `dtype`, `rope_parameters` and `tokenizer_class: TokenizersBackend`.
4.x reads `torch_dtype`, a top-level `rope_theta` with `rope_scaling`, and has no
TokenizersBackend class. Without the older keys a 4.x loader fails on the tokenizer and,
worse, silently runs with its default rope_theta (10000, wrong for most models). The added
keys repeat what the new ones say; transformers 5 reads the new ones.
"""

from __future__ import annotations

import json
from pathlib import Path

# rope_parameters entries that 4.x reads at the top level of config.json, not in rope_scaling.
_TOP_LEVEL_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def add_legacy_keys(folder: Path) -> list[str]:
    """Add the 4.x spelling of what config.json and tokenizer_config.json in `folder` say,
    where it is missing; returns the keys added (file:key)."""
    added = _update_json(folder / "config.json", _legacy_config_keys)
    added += _update_json(folder / "tokenizer_config.json", _legacy_tokenizer_keys)
    return added


def _update_json(path: Path, legacy) -> list[str]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    changes = legacy(data)
    if changes:
        data.update(changes)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [f"{path.name}:{key}" for key in changes]


def _legacy_config_keys(config: dict) -> dict:
    changes = {}
    if "dtype" in config and "torch_dtype" not in config:
        changes["torch_dtype"] = config["dtype"]
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return changes  # absent, or one dict per attention type: no 4.x spelling
    for key in _TOP_LEVEL_ROPE_KEYS:
        if key in rope and key not in config:
            changes[key] = rope[key]
    if rope.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        changes["rope_scaling"] = {k: v for k, v in rope.items() if k not in _TOP_LEVEL_ROPE_KEYS}
    return changes


def _legacy_tokenizer_keys(tokenizer_config: dict) -> dict:
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        # The same tokenizer.json, read by the class 4.x has for it; 5.x maps it back.
        return {"tokenizer_class": "PreTrainedTokenizerFast"}
    return {}
