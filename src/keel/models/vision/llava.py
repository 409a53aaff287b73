"""LLaVA-1.5 and LLaVA-NeXT: a CLIP-style tower, an MLP projector, a Llama/Mistral decoder.

One image becomes `<image>` x N, N the number of features the model scatters into those
positions. LLaVA-1.5: one fixed-size crop, N = patches (+ the CLS token when the feature
strategy is "full"). LLaVA-NeXT ("anyres"): the image is tiled at the best grid resolution
plus one overview crop; N counts the unpadded tile features, one newline feature per row and
the overview crop (the port of LlavaNextProcessor._get_number_of_features). The model reads
tower hidden states at `vision_feature_layer`: the layers after it and the tower's pooling
head never run into the loss, so they are `unused_parameters` (frozen always; a trainable
tower would otherwise leave DDP with parameters that never get a gradient).
"""

from __future__ import annotations

import torch

from keel.models.vision.family import PreparedImage, VisionFamily

TOWER = "model.vision_tower"
# Modules of a tower that LLaVA never reads (it takes encoder hidden states, not the pooled output)
_POOLING_MODULES = {
    "clip_vision_model": ("post_layernorm",),
    "siglip_vision_model": ("post_layernorm", "head"),
}
# Towers that put a CLS token before the patches
_TOWERS_WITH_CLS = ("clip_vision_model",)


class LlavaFamily(VisionFamily):
    name = "llava"
    model_types = ("llava",)
    tower = (TOWER,)
    projector = ("model.multi_modal_projector",)
    image_token = "<image>"

    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        if not images:
            return []
        pixel_values = image_processor(images=images, return_tensors="pt")["pixel_values"]
        prepared = []
        for pixels in pixel_values:
            height, width = pixels.shape[-2:]
            num_tokens = _grid_features(config, height, width) + _extra_features(config)
            prepared.append(
                PreparedImage(
                    tensors={"pixel_values": pixels[None]},
                    text=self.image_token * num_tokens,
                    num_tokens=num_tokens,
                )
            )
        return prepared

    def model_inputs(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        return {"pixel_values": torch.cat([image["pixel_values"] for image in images])}

    def unused_parameters(self, config) -> tuple[str, ...]:
        vision = config.vision_config
        layers = config.vision_feature_layer
        layers = layers if isinstance(layers, (list, tuple)) else [layers]
        # hidden_states[i] is the output of encoder layer i - 1 (index 0: the embeddings)
        last_read = max(i if i >= 0 else vision.num_hidden_layers + 1 + i for i in layers)
        unused_layers = tuple(
            f"{TOWER}.encoder.layers.{i}" for i in range(last_read, vision.num_hidden_layers)
        )
        pooling = _POOLING_MODULES.get(vision.model_type, ())
        return unused_layers + tuple(f"{TOWER}.{name}" for name in pooling)


def _grid_features(config, height: int, width: int) -> int:
    patch = config.vision_config.patch_size
    return (height // patch) * (width // patch)


def _extra_features(config) -> int:
    """+1 for a tower's CLS token, -1 for the "default" strategy, which drops the first
    feature (the CLS token of CLIP; a patch of a tower without one)."""
    has_cls = config.vision_config.model_type in _TOWERS_WITH_CLS
    return int(has_cls) - int(config.vision_feature_select_strategy == "default")


class LlavaNextFamily(LlavaFamily):
    name = "llava_next"
    model_types = ("llava_next",)
    # the learned newline embedding after each row of tile features belongs to the projector
    projector = ("model.multi_modal_projector", "model.image_newline")

    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        if not images:
            return []
        prepared = []
        for image in images:  # one at a time: the processor pads tiles to the batch's most
            out = image_processor(images=[image], return_tensors="pt")
            height, width = out["pixel_values"].shape[-2:]
            original_height, original_width = out["image_sizes"][0].tolist()
            tiles = _tile_features(
                config, image_processor, (original_height, original_width), (height, width)
            )
            num_tokens = tiles + _grid_features(config, height, width) + _extra_features(config)
            prepared.append(
                PreparedImage(
                    tensors={
                        "pixel_values": out["pixel_values"],
                        "image_sizes": out["image_sizes"],
                    },
                    text=self.image_token * num_tokens,
                    num_tokens=num_tokens,
                )
            )
        return prepared

    def model_inputs(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """pixel_values [images, most tiles, C, H, W], zero tiles after an image's own (as the
        processor pads a batch; the model reads each image's count from image_sizes)."""
        if not images:
            return {}
        most = max(image["pixel_values"].shape[1] for image in images)
        padded = [
            torch.nn.functional.pad(
                image["pixel_values"], (0, 0, 0, 0, 0, 0, 0, most - image["pixel_values"].shape[1])
            )
            for image in images
        ]
        return {
            "pixel_values": torch.cat(padded),
            "image_sizes": torch.cat([image["image_sizes"] for image in images]),
        }


def _tile_features(config, image_processor, original: tuple[int, int], crop: tuple[int, int]):
    """Features of the high-resolution tiles: the best-fit grid unpadded to the image's
    aspect ratio, plus one newline feature per row."""
    from transformers.image_processing_utils import select_best_resolution

    best_height, best_width = select_best_resolution(
        list(original), image_processor.image_grid_pinpoints
    )
    patch = config.vision_config.patch_size
    height = (crop[0] // patch) * (best_height // crop[0])
    width = (crop[1] // patch) * (best_width // crop[1])
    original_height, original_width = original
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        height -= (height - new_height) // 2 * 2
    else:
        new_width = int(round(original_width * (height / original_height), 7))
        width -= (width - new_width) // 2 * 2
    return height * width + height


LLAVA = LlavaFamily()
LLAVA_NEXT = LlavaNextFamily()
