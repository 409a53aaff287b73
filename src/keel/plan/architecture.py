"""The architecture `keel plan` reads: `config.json` alone (a folder holding nothing else
works), or for a bundled model that was never converted, the GGUF file's header; and the
model built from it on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from keel.config import RunConfig
from keel.config.schema import BUNDLED_PREFIX
from keel.errors import ModelError
from keel.models.hub import CONFIG_FILES, download_hub_model, is_hub_id


def read_architecture(cfg: RunConfig, model_dir: Path | None = None, log=print):
    """The model's `PretrainedConfig`, from `model_dir`'s config.json, or from `cfg.model`.

    For `bundled:NAME` the converted folder is used when it exists; otherwise the GGUF
    file's header (no tensor is read or dequantized).
    """
    from transformers import AutoConfig

    remote = cfg.model.trust_remote_code
    if model_dir is None and cfg.model.path.startswith(BUNDLED_PREFIX):
        model_dir = _bundled_dir(cfg)
        if model_dir is None:
            from keel.models.bundled import BUNDLED_MODELS, find_gguf

            gguf = find_gguf(BUNDLED_MODELS[cfg.model.path.removeprefix(BUNDLED_PREFIX)])
            log(
                f"reading the architecture from {gguf.name} (the bundled model is not "
                f"converted yet; keel converts it to float32)"
            )
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            config.dtype = torch.float32
            return config
    if model_dir is None and is_hub_id(cfg.model.path):
        # config.json alone, not the weights: a plan answers in seconds for any model size
        model_dir = download_hub_model(
            cfg.model.path, cfg.model.revision, files=CONFIG_FILES, log=log
        )
    directory = Path(model_dir if model_dir is not None else cfg.model.path).expanduser()
    if not (directory / "config.json").is_file():
        raise ModelError(
            f"{directory} has no config.json; keel plan needs the model's "
            f"config.json (the weights are not needed)"
        )
    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=remote)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read the architecture in {directory}/config.json: {e}") from e


def _bundled_dir(cfg: RunConfig) -> Path | None:
    from keel.models.bundled import BUNDLED_MODELS, MARKER_FILE

    name = cfg.model.path.removeprefix(BUNDLED_PREFIX)
    if name not in BUNDLED_MODELS:
        names = ", ".join(BUNDLED_PREFIX + n for n in BUNDLED_MODELS)
        raise ModelError(f"unknown bundled model {name!r}; available: {names}")
    target = Path(cfg.model.cache_dir).expanduser() / "models" / name
    return target if (target / MARKER_FILE).is_file() else None


def build_meta_model(config, *, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model of `config` on the meta device (no memory behind it), as training loads it:
    `AutoModelForImageTextToText` for a vision-language family (keel.models.vision), else
    `AutoModelForCausalLM`."""
    from keel.models.loading import model_class

    auto, kind = model_class(config)
    try:
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(f"cannot build a {kind} model from this config.json: {e}") from e
