"""Vision-language model families: which one a model folder is, and its image processing.

keel asks this registry, never `config.model_type`: `family_of(config)` gives the family
plugin (None for a text model), `vision_processing(model_dir, settings, log)` the family, its
image processor and the model config that data, train and infer share for one run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from keel.errors import ModelError
from keel.models.vision.family import PLACEHOLDER, PreparedImage, VisionFamily
from keel.models.vision.gemma3 import GEMMA3
from keel.models.vision.glm4v import GLM4V
from keel.models.vision.idefics3 import IDEFICS3
from keel.models.vision.llava import LLAVA, LLAVA_NEXT
from keel.models.vision.processor import load_image_processor
from keel.models.vision.qwen2_vl import QWEN2_5_VL, QWEN2_VL, QWEN3_VL

# One line per family; add a family by importing its record above and listing it here.
FAMILIES: tuple[VisionFamily, ...] = (
    QWEN2_VL,
    QWEN2_5_VL,
    QWEN3_VL,
    LLAVA,
    LLAVA_NEXT,
    IDEFICS3,
    GEMMA3,
    GLM4V,
)

# Families that need trust_remote_code, and the supported family to use instead.
_REFUSED = {"cogvlm": "GLM-4V (model_type glm4v), CogVLM's successor"}

__all__ = [
    "FAMILIES",
    "PLACEHOLDER",
    "PreparedImage",
    "VisionFamily",
    "VisionProcessing",
    "VisionSettings",
    "family_of",
    "is_vision_model_dir",
    "vision_processing",
]


class VisionSettings(Protocol):
    """The `model.vision` config section (keel.config.schema), as this package reads it."""

    freeze_tower: bool
    freeze_projector: bool
    image_max_pixels: int
    image_min_pixels: int


@dataclass(frozen=True)
class VisionProcessing:
    """What one run needs to turn images into model inputs."""

    family: VisionFamily
    image_processor: object
    model_config: object

    def prepare_images(self, images: list) -> list[PreparedImage]:
        """The family's `prepare_images` with this run's processor and config."""
        return self.family.prepare_images(self.image_processor, images, self.model_config)


def _get(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def family_of(config) -> VisionFamily | None:
    """The family of a model config (a transformers config or config.json's dict); None for
    text models. Refuses families keel cannot load, naming the one to use."""
    model_type = str(_get(config, "model_type") or "")
    architectures = [str(a) for a in (_get(config, "architectures") or [])]
    for needle, instead in _REFUSED.items():
        if needle in model_type.lower() or any(needle in a.lower() for a in architectures):
            raise ModelError(
                f"model_type {model_type or architectures[0]!r} is not supported: it needs "
                f"trust_remote_code (model code from the Hub). Use {instead}."
            )
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return None


def _config_json(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def is_vision_model_dir(model_dir: Path) -> bool:
    """Whether the folder holds a supported vision-language model (reads config.json only)."""
    return family_of(_config_json(model_dir)) is not None


def vision_processing(
    model_dir: Path, settings: VisionSettings | None, log: Callable[[str], None] = print
) -> VisionProcessing | None:
    """The family, image processor and config of the model in `model_dir`; None for a text
    model. `settings` bound the image size (None: the folder's processor as saved)."""
    if family_of(_config_json(model_dir)) is None:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    family = family_of(config)
    overrides = {}
    if settings is not None:
        overrides = family.image_processor_kwargs(
            min_pixels=settings.image_min_pixels, max_pixels=settings.image_max_pixels
        )
    processor = load_image_processor(model_dir, family, overrides=overrides, log=log)
    return VisionProcessing(family=family, image_processor=processor, model_config=config)
