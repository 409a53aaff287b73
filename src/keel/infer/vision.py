"""Prompts with images for `keel chat` and `keel serve`: the family plugin's expansion of
each `<image>` placeholder and the forward arguments the model takes beside the token ids.

The conversation is rendered with the model's chat template as text (each image as the
user-side placeholder `<image>`), every placeholder is replaced by the family's text for
its image (`PreparedImage.text`, e.g. Qwen2-VL's vision start, N image pads, vision end),
and the result is tokenized the way `apply_chat_template` tokenizes (no extra specials).
Text-only conversations never come here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from keel.errors import KeelError
from keel.models.vision import VisionProcessing, family_of, vision_processing
from keel.models.vision.family import PLACEHOLDER


@dataclass(frozen=True)
class ImagePrompt:
    """One conversation with its images, ready for the model.

    input_ids: the prompt's token ids, image tokens expanded.
    inputs: forward keyword arguments besides input_ids, each for this one prompt
      (e.g. pixel_values, image_grid_thw, mm_token_type_ids [1, T]); on the CPU.
    rope_positions: [3, T] rotary positions for "mrope" families, else None.
    """

    input_ids: list[int]
    inputs: dict[str, torch.Tensor]
    rope_positions: torch.Tensor | None = None

    @property
    def rope_delta(self) -> int:
        """How far the next position lies from the token count (M-RoPE gives an image
        fewer positions than tokens): decode positions are `length + rope_delta`."""
        if self.rope_positions is None:
            return 0
        return int(self.rope_positions.max()) + 1 - len(self.input_ids)


def base_model(model):
    """The transformers model under a PEFT wrapper (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def vision_of(model, log=print) -> VisionProcessing | None:
    """The family and image processor of a loaded vision-language model; None for a text
    model. The image processor comes from the folder the model was loaded from."""
    net = base_model(model)
    if family_of(net.config) is None:
        return None
    return vision_processing(Path(net.name_or_path), None, log)


def require_vision(model, log=print) -> VisionProcessing:
    """`vision_of(model)`, or a KeelError naming the model when it takes no images."""
    vision = vision_of(model, log)
    if vision is None:
        net = base_model(model)
        raise KeelError(
            f"--image: {net.name_or_path} is a text model "
            f"(model_type {net.config.model_type!r}) and takes no images; give a "
            "vision-language model (Qwen2-VL, LLaVA, ...) as --model"
        )
    return vision


def with_images_first(text: str, count: int) -> str:
    """`text` with `count` placeholders in front when it has none of its own (a prompt
    that does not say where its images go gets them before the text)."""
    if count and PLACEHOLDER not in text:
        return PLACEHOLDER * count + text
    return text


def render(tokenizer, messages: list[dict]) -> str:
    """The chat template's text of `messages`, ending with the assistant's turn prompt."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_with_images(
    tokenizer, messages: list[dict], images: list, vision: VisionProcessing
) -> ImagePrompt:
    """Tokenize `messages` (content strings holding `<image>` placeholders) with `images`
    (PIL images, in placeholder order); KeelError if the counts differ."""
    text = render(tokenizer, messages)
    pieces = text.split(PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise KeelError(
            f"the prompt has {len(pieces) - 1} {PLACEHOLDER} placeholder(s) but "
            f"{len(images)} image(s); give one image per placeholder"
        )
    family = vision.family
    prepared = vision.prepare_images(list(images))
    expanded = pieces[0] + "".join(p.text + rest for p, rest in zip(prepared, pieces[1:]))
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    tensors = [p.tensors for p in prepared]
    ids_tensor = torch.tensor([ids])  # [1, T]
    inputs = {
        **family.model_inputs(tensors),
        **family.token_inputs(ids_tensor, vision.model_config),
    }
    positions = None
    if family.rope == "mrope":
        positions = family.rope_positions(ids, tensors, vision.model_config)  # [3, T]
    return ImagePrompt(input_ids=ids, inputs=inputs, rope_positions=positions)


def stored_image_prompt(row: dict, config) -> ImagePrompt:
    """The ImagePrompt of a prepared data row (a grpo prompt: input_ids, image_blobs and,
    for M-RoPE families, rope_positions, 3 per token), for a model of `config`."""
    from keel.models.vision.blobs import unpack

    family = family_of(config)
    tensors = [unpack(blob) for blob in row["image_blobs"]]
    ids = list(row["input_ids"])
    inputs = {
        **family.model_inputs(tensors),
        **family.token_inputs(torch.tensor([ids]), config),  # [1, T]
    }
    rope = row.get("rope_positions")
    positions = None if rope is None else torch.tensor(rope, dtype=torch.long).view(-1, 3).t()
    return ImagePrompt(input_ids=ids, inputs=inputs, rope_positions=positions)
