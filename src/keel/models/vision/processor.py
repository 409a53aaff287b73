"""Load a model folder's image processor, on PIL when torchvision is missing.

Hub folders name the torchvision processor class in `preprocessor_config.json` (e.g.
"Qwen2VLImageProcessor", or the older "...Fast"). transformers 5.x picks the backend itself:
without torchvision `AutoImageProcessor` returns the PIL twin ("Qwen2VLImageProcessorPil"),
which computes the same numbers. We say once which class is used when it is not the named one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from keel.errors import ModelError
from keel.models.vision.family import VisionFamily

PREPROCESSOR_FILE = "preprocessor_config.json"


def load_image_processor(
    model_dir: Path,
    family: VisionFamily,
    *,
    overrides: dict | None = None,
    log: Callable[[str], None] = print,
):
    """The image processor of `model_dir`, with `overrides` (the family's pixel bounds)
    replacing the saved values."""
    from transformers import AutoImageProcessor

    named = _named_class(Path(model_dir))
    try:
        processor = AutoImageProcessor.from_pretrained(str(model_dir), **(overrides or {}))
    except (OSError, ValueError, ImportError) as exc:
        raise ModelError(
            f"{family.name}: cannot load the image processor of {model_dir} ({exc}); "
            f"the folder needs the model's {PREPROCESSOR_FILE}"
        ) from None
    used = type(processor).__name__
    if named and used != named.removesuffix("Fast"):
        why = (
            "the PIL backend: torchvision is not installed; same numbers"
            if used.endswith("Pil")
            else "the class transformers picked"
        )
        log(f"image processor: {PREPROCESSOR_FILE} names {named}; using {used} ({why})")
    return processor


def _named_class(model_dir: Path) -> str | None:
    path = model_dir / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("image_processor_type")
    except (OSError, ValueError):
        return None
