"""Other frameworks' configs as they are: recognise the dialect, translate it to a keel
config, and say what became of every key (mapped, ignored and why, refused and why).

Each dialect module has one entry point, `translate_<dialect>(raw, source) -> Translation`;
`source` is their YAML file, for the relative paths it names (a DeepSpeed JSON).
"""

from __future__ import annotations

from pathlib import Path

from keel.config.dialects.report import (
    Dialect,
    KeyFate,
    Translation,
    refusal_problems,
    render_report,
)

# A keel config is a mapping of these sections; neither dialect has a key of these names
# holding a mapping, so a config with one is keel's own.
KEEL_SECTIONS = ("model", "method", "data", "train", "output")


def detect_dialect(raw: dict) -> Dialect | None:
    """llamafactory, axolotl, or None for a keel config (or anything else)."""
    if not isinstance(raw, dict):
        return None
    if any(isinstance(raw.get(section), dict) for section in KEEL_SECTIONS):
        return None
    if "model_name_or_path" in raw or ("stage" in raw and "finetuning_type" in raw):
        return "llamafactory"
    if "base_model" in raw:
        return "axolotl"
    return None


# LLaMA-Factory's v1 trainer (llamafactory/v1): the model is a string beside these keys
_LLAMAFACTORY_V1_KEYS = (
    "model_class",
    "peft_config",
    "dist_config",
    "train_dataset",
    "kernel_config",
    "quant_config",
    "optim_config",
    "init_config",
)


def unread_dialect(raw: dict) -> str | None:
    """Why keel cannot read `raw`, when it is another framework's config in a format keel
    does not translate (LLaMA-Factory's v1 configs); None otherwise."""
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), str):
        return None
    theirs = [key for key in _LLAMAFACTORY_V1_KEYS if key in raw]
    if not theirs:
        return None
    return (
        f"this is a LLaMA-Factory v1 config (model: {raw['model']}, {', '.join(theirs)}), "
        "the format of their experimental v1 trainer; keel translates LLaMA-Factory's v0 "
        "configs (model_name_or_path, stage, finetuning_type, dataset: their examples/"
        "train_lora, train_full, ...). Write the run in that format or as a keel config "
        "(docs/dialects.md lists which of their keys become which of keel's)"
    )


def translate(raw: dict, source: Path, model_override: dict | None = None) -> Translation:
    """Their config `raw`, read from `source`, as a keel Translation. `model_override`:
    keel's `model` section as command-line overrides set it ({"path": ..., "revision": ...}),
    the model that will train, for the checks that read the model."""
    dialect, model_override = detect_dialect(raw), model_override or {}
    if dialect == "llamafactory":
        from keel.config.dialects.llamafactory import translate_llamafactory

        return translate_llamafactory(raw, Path(source), model_override)
    if dialect == "axolotl":
        from keel.config.dialects.axolotl import translate_axolotl

        return translate_axolotl(raw, Path(source), model_override)
    raise AssertionError(f"{source} is not a LLaMA-Factory or Axolotl config")


__all__ = [
    "KEEL_SECTIONS",
    "KeyFate",
    "Translation",
    "detect_dialect",
    "refusal_problems",
    "render_report",
    "translate",
    "unread_dialect",
]
