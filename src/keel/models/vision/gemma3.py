"""Gemma 3: fixed-size SigLIP images, bidirectional attention inside each image.

One image becomes "\\n\\n<start_of_image>" + "<image_soft_token>" x mm_tokens_per_image +
"<end_of_image>\\n\\n", as Gemma3Processor writes it (with pan-and-scan on, the original
image and its crops each get that block inside the processor's sentence). The forward takes
`pixel_values` [images, 3, H, W] and `token_type_ids` (1 on the soft tokens): Gemma 3 lets the
tokens of one image attend to each other both ways, and without `token_type_ids` the mask is
plain causal, so training must always pass them. That attention is not causal
(`image_attention`): keel's varlen attention (padding-free micro-batches) does not apply,
and packing is refused (transformers 5.24 builds its packed mask wrongly). Every
image is resized to the tower's size: model.vision's image_min/max_pixels do not apply.
"""

from __future__ import annotations

import torch

from keel.models.vision.family import PreparedImage, VisionFamily

BOI = "<start_of_image>"
EOI = "<end_of_image>"
IMAGE_SOFT_TOKEN = "<image_soft_token>"

# Gemma3Processor's defaults for pan-and-scan settings a saved preprocessor_config leaves null
_PAN_AND_SCAN_DEFAULTS = {
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def image_text(tokens_per_image: int, num_crops: int) -> str:
    """The text of one image (and its pan-and-scan crops), as Gemma3Processor expands it."""
    block = f"\n\n{BOI}{IMAGE_SOFT_TOKEN * tokens_per_image}{EOI}\n\n"
    if not num_crops:
        return block
    crops = " ".join([block] * num_crops)
    return (
        f"Here is the original image {block} and here are some crops to help you see better {crops}"
    )


def _pan_and_scan_kwargs(image_processor) -> dict:
    if not getattr(image_processor, "do_pan_and_scan", None):
        return {"do_pan_and_scan": False}
    kwargs = {"do_pan_and_scan": True}
    for key, default in _PAN_AND_SCAN_DEFAULTS.items():
        value = getattr(image_processor, key, None)
        kwargs[key] = default if value is None else value
    return kwargs


class Gemma3Family(VisionFamily):
    name = "gemma3"
    model_types = ("gemma3",)
    tower = ("model.vision_tower",)
    projector = ("model.multi_modal_projector",)
    image_token = IMAGE_SOFT_TOKEN
    image_attention = "bidirectional"

    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        tokens_per_image = config.mm_tokens_per_image
        options = _pan_and_scan_kwargs(image_processor)
        prepared = []
        for image in images:
            out = image_processor(images=[image], return_tensors="pt", **options)
            num_crops = int(out["num_crops"][0])
            prepared.append(
                PreparedImage(
                    tensors={"pixel_values": out["pixel_values"]},
                    text=image_text(tokens_per_image, num_crops),
                    num_tokens=tokens_per_image * (1 + num_crops),
                )
            )
        return prepared

    def model_inputs(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        return {"pixel_values": torch.cat([image["pixel_values"] for image in images])}

    def token_inputs(self, input_ids: torch.Tensor, config) -> dict[str, torch.Tensor]:
        return {"token_type_ids": (input_ids == config.image_token_id).long()}

    def unused_parameters(self, config) -> tuple[str, ...]:
        # Gemma 3 reads the SigLIP tower's last hidden state, never its attention-pooling head
        # (released checkpoints set vision_use_head false; a config that keeps it has a head
        # no forward reaches)
        if getattr(config.vision_config, "vision_use_head", False):
            return ("model.vision_tower.head",)
        return ()


GEMMA3 = Gemma3Family()
