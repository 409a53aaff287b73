"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: dynamic-resolution images, 3-D rotary positions.

One image becomes `<|vision_start|>` + `<|image_pad|>` x N + `<|vision_end|>`, with
N = t*h*w / merge_size^2 for the processor's patch grid (t, h, w). The model's forward needs
the patches (`pixel_values` [patches, C*T*P*P], concatenated over images), the grids
(`image_grid_thw` [images, 3]) and `mm_token_type_ids` (1 on image pads). Positions are 3-D
(M-RoPE): `rope_positions` ports `get_rope_index` for images, per sample, so packed rows keep
each sample's own positions. The projector (`merger`; Qwen3-VL also its `deepstack_merger_list`)
sits inside `model.visual`, so the tower is listed by its parts.
"""

from __future__ import annotations

import torch

from keel.models.vision.family import PreparedImage, VisionFamily

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_TOKEN_TYPE = 1  # mm_token_type_ids: 0 text, 1 image, 2 video


class Qwen2VLFamily(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL (same inputs and positions for images; 2.5 adds window
    attention inside the tower, which changes nothing here)."""

    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    tower = ("model.visual.patch_embed", "model.visual.blocks")
    projector = ("model.visual.merger",)
    image_token = IMAGE_PAD
    rope = "mrope"

    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        if not images:
            return []
        out = image_processor(images=images, return_tensors="pt")
        grids = out["image_grid_thw"]
        patches_per_image = grids.prod(dim=-1).tolist()
        pixel_values = torch.split(out["pixel_values"], patches_per_image)
        merge = image_processor.merge_size
        prepared = []
        for index, (pixels, patches) in enumerate(zip(pixel_values, patches_per_image)):
            num_tokens = int(patches) // merge**2
            prepared.append(
                PreparedImage(
                    tensors={"pixel_values": pixels, "image_grid_thw": grids[index : index + 1]},
                    text=VISION_START + IMAGE_PAD * num_tokens + VISION_END,
                    num_tokens=num_tokens,
                )
            )
        return prepared

    def image_processor_kwargs(self, *, min_pixels: int, max_pixels: int) -> dict:
        # The processor keeps its bounds in `size`, but a hub folder's own min_pixels and
        # max_pixels keys replace `size` when loaded: override all three.
        return {
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            "min_pixels": min_pixels,
            "max_pixels": max_pixels,
        }

    def model_inputs(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        return {
            "pixel_values": torch.cat([image["pixel_values"] for image in images]),
            "image_grid_thw": torch.cat([image["image_grid_thw"] for image in images]),
        }

    def token_inputs(self, input_ids: torch.Tensor, config) -> dict[str, torch.Tensor]:
        image_tokens = input_ids == config.image_token_id
        return {"mm_token_type_ids": image_tokens.long() * IMAGE_TOKEN_TYPE}

    def rope_positions(
        self, input_ids: list[int], images: list[dict[str, torch.Tensor]], config
    ) -> torch.Tensor:
        """[3, T]: text tokens count up on all three rows; an image's tokens start where the
        text stopped and spread over (t, h, w) of its merged grid; the text after it goes on
        from the image's largest position + 1 (what `get_rope_index` gives for images)."""
        merge = config.vision_config.spatial_merge_size
        grids = iter([g for image in images for g in image["image_grid_thw"].tolist()])
        is_image = [token == config.image_token_id for token in input_ids]
        pieces, position, start = [], 0, 0
        while start < len(input_ids):
            end = start
            while end < len(input_ids) and is_image[end] == is_image[start]:
                end += 1
            if is_image[start]:
                t, h, w = next(grids)
                pieces.append(_grid_positions(position, t, h // merge, w // merge))
                position += max(h, w) // merge
            else:
                pieces.append(torch.arange(position, position + end - start).expand(3, -1))
                position += end - start
            start = end
        if not pieces:
            return torch.zeros(3, 0, dtype=torch.long)
        return torch.cat(pieces, dim=1)


def _grid_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    """Positions of one image's merged tokens in (t, h, w) raster order, offset by `start`."""
    grid_t, grid_h, grid_w = torch.meshgrid(
        torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
    )
    return torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + start


class Qwen2_5VLFamily(Qwen2VLFamily):
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: a learned position embedding in the tower, and DeepStack mergers that feed
    features of middle tower blocks into the first decoder layers (part of the projector)."""

    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    tower = ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")
    projector = ("model.visual.merger", "model.visual.deepstack_merger_list")


QWEN2_VL = Qwen2VLFamily()
QWEN2_5_VL = Qwen2_5VLFamily()
QWEN3_VL = Qwen3VLFamily()
