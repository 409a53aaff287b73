"""What keel needs to know about one vision-language model family, in one record.

A family is a plugin: everything that differs between Qwen2-VL, LLaVA, Idefics3 ... lives in
its subclass of `VisionFamily` (one small module per family), and the rest of keel asks the
family, never the model type:

- models/ (loading, adapters, freezing, export) reads the module paths: `tower`,
  `projector`, `language_model`, and `unused_parameters` (tower weights the forward never
  reads, e.g. LLaVA's layers after `vision_feature_layer`).
- data/ (encoding) calls `prepare_images` once per row: the image processor's tensors for
  each image (cached with the tokens) and the text that replaces the user's `<image>`
  placeholder for that image (the family's special tokens, repeated as the model expects).
- train/ and infer/ call `model_inputs` with a micro-batch's images (in token order) and
  `token_inputs` with its input ids: the keyword arguments the model's forward takes
  besides input_ids. Families with 3-D rotary positions (Qwen2-VL, GLM-4V) also give
  `rope_positions` for one sample.

Module paths are prefixes of parameter names (a path names a module or, rarely, one parameter:
LLaVA-NeXT's `model.image_newline`) in the transformers 5.x model tree of `AutoModelForImageTextToText`
(e.g. `model.visual`, `model.language_model`), not the names in older checkpoint files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

PLACEHOLDER = "<image>"  # the user-side image placeholder (LLaMA-Factory's and TRL's)


@dataclass(frozen=True)
class PreparedImage:
    """One image after the family's image processor.

    tensors: what the model's forward needs for this image alone, each with this image's
      rows only (e.g. Qwen2-VL: pixel_values [patches, 1176] and image_grid_thw [1, 3];
      LLaVA: pixel_values [1, 3, H, W]); `model_inputs` combines several images' tensors.
    text: what replaces one `<image>` placeholder in the rendered prompt (e.g. Qwen2-VL:
      "<|vision_start|>" + "<|image_pad|>" * 12 + "<|vision_end|>").
    num_tokens: how many image-feature tokens of `text` the model fills (12 above).
    """

    tensors: dict[str, torch.Tensor]
    text: str
    num_tokens: int


class VisionFamily(ABC):
    """Base record of a family; subclasses set the class attributes, implement the two
    abstract methods (every family processes images and builds its own forward inputs) and
    override what else differs."""

    name: str = ""  # keel's name, shown in logs and errors (e.g. "qwen2_vl")
    model_types: tuple[str, ...] = ()  # config.model_type values this family loads
    tower: tuple[str, ...] = ()  # module paths of the vision encoder (without the projector)
    projector: tuple[str, ...] = ()  # module paths of the projector into the LM's embeddings
    language_model: str = "model.language_model"  # module path of the decoder stack
    image_token: str = ""  # the token whose embeddings the model replaces with image features
    rope: str = "1d"  # "1d", or "mrope": 3-D rotary positions computed per sample
    # "causal", or "bidirectional": an image's tokens also attend to the later tokens of the
    # same image (Gemma 3, from token_type_ids); keel's varlen attention is causal only
    image_attention: str = "causal"

    @abstractmethod
    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        """Run the image processor on PIL images; one PreparedImage per image, in order.
        `config` is the model's config: some families count image tokens from it (LLaVA:
        the tower's patch size and feature strategy)."""

    def image_processor_kwargs(self, *, min_pixels: int, max_pixels: int) -> dict:
        """Overrides for the image processor's `from_pretrained` that bound the pixels of a
        resized image (model.vision.image_min/max_pixels); {} for fixed-size families."""
        return {}

    @abstractmethod
    def model_inputs(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Forward keyword arguments for a micro-batch whose images (their PreparedImage
        tensors) are `images`, in token order across the micro-batch; {} for none."""

    def token_inputs(self, input_ids: torch.Tensor, config) -> dict[str, torch.Tensor]:
        """Per-token forward arguments computed from the ids (e.g. Qwen2-VL's
        mm_token_type_ids, Gemma 3's token_type_ids); {} when the family needs none."""
        return {}

    def rope_positions(
        self, input_ids: list[int], images: list[dict[str, torch.Tensor]], config
    ) -> torch.Tensor | None:
        """[3, T] rotary positions (temporal, height, width) of one sample, for rope
        "mrope"; None for 1-D families."""
        return None

    def unused_parameters(self, config) -> tuple[str, ...]:
        """Module paths inside the tower that the forward never reads (frozen always)."""
        return ()


def module_or_parameter(model, path: str):
    """What a family path names in `model`: a module, or a bare parameter (LLaVA-NeXT's
    `model.image_newline`, a learned embedding that belongs to its projector)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model.get_parameter(path)
