"""GLM-4V (GLM-4.1V, GLM-4.5V): CogVLM's successor, Qwen2-VL's image inputs and positions.

One image becomes `<|begin_of_image|>` + `<|image|>` x N + `<|end_of_image|>` with
N = t*h*w / merge_size^2, as Glm4vProcessor expands it. The forward takes what Qwen2-VL's
takes (patches, `image_grid_thw`, `mm_token_type_ids`), and `get_rope_index` treats images
exactly as Qwen2-VL's does (it differs only for videos, which keel does not take), so this
family reuses the Qwen2-VL plugin and changes the tokens and the module paths. The tower ends
in a 2x2 convolution (`downsample`) into the language model's width and the `merger` MLP:
together the projector.
"""

from __future__ import annotations

from dataclasses import replace

from keel.models.vision.family import PreparedImage
from keel.models.vision.qwen2_vl import Qwen2VLFamily

BEGIN_OF_IMAGE = "<|begin_of_image|>"
END_OF_IMAGE = "<|end_of_image|>"
IMAGE_TOKEN = "<|image|>"
# GLM-4V's smart_resize counts the pixels of both temporal patches of an image (an image is
# its frame twice), so its size bounds are twice the pixels of the resized image
_TEMPORAL_PATCH_SIZE = 2


class Glm4vFamily(Qwen2VLFamily):
    name = "glm4v"
    model_types = ("glm4v", "glm4v_moe")
    tower = (
        "model.visual.embeddings",
        "model.visual.patch_embed",
        "model.visual.post_conv_layernorm",
        "model.visual.blocks",
        "model.visual.post_layernorm",
    )
    projector = ("model.visual.downsample", "model.visual.merger")
    image_token = IMAGE_TOKEN

    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        return [
            replace(image, text=BEGIN_OF_IMAGE + IMAGE_TOKEN * image.num_tokens + END_OF_IMAGE)
            for image in super().prepare_images(image_processor, images, config)
        ]

    def image_processor_kwargs(self, *, min_pixels: int, max_pixels: int) -> dict:
        return {
            "size": {
                "shortest_edge": min_pixels * _TEMPORAL_PATCH_SIZE,
                "longest_edge": max_pixels * _TEMPORAL_PATCH_SIZE,
            }
        }


GLM4V = Glm4vFamily()
