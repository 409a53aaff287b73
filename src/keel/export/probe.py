"""The inputs the merge check runs through the model before and after merging: a few token
ids spread over the vocabulary, and for a vision-language model an image in their middle,
so the merged projector and image path are compared too, not only the language model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

PROBE_TOKENS = 16
PROBE_IMAGE_SIZE = (64, 48)  # width, height: a few image tokens in every family


def probe_inputs(model, base_dir: Path, tokenizer, log: Callable[[str], None]) -> dict:
    """Forward keyword arguments of the merge probe ([1, T] input ids, and image inputs)."""
    config = model.config
    vocab = config.get_text_config().vocab_size
    ids = (torch.arange(PROBE_TOKENS) * 7919 % vocab).tolist()  # spread over the vocabulary
    from keel.models.vision import vision_processing

    vision = vision_processing(base_dir, None, log)
    if vision is None:
        return {"input_ids": torch.tensor([ids])}
    prepared = vision.prepare_images([_probe_image()])[0]
    image_ids = tokenizer(prepared.text, add_special_tokens=False)["input_ids"]
    middle = len(ids) // 2
    input_ids = torch.tensor([ids[:middle] + image_ids + ids[middle:]])  # [1, T]
    return {
        "input_ids": input_ids,
        **vision.family.model_inputs([prepared.tensors]),
        **vision.family.token_inputs(input_ids, config),
    }


def _probe_image():
    """A smooth colour gradient (any image works; a flat one would hide a wrong patch order)."""
    from PIL import Image

    width, height = PROBE_IMAGE_SIZE
    rows = torch.linspace(0, 255, height)[:, None].expand(height, width)
    cols = torch.linspace(0, 255, width)[None, :].expand(height, width)
    pixels = torch.stack([rows, cols, (rows + cols) / 2], dim=-1).to(torch.uint8)
    return Image.fromarray(pixels.numpy())
