"""Idefics3 and SmolVLM: images split into square crops plus a downscaled global view.

The image processor resizes an image, cuts it into rows x cols crops of the tower's size and
adds the whole image at that size (a small image is only the global view). Each crop and the
global view fill `image_seq_len` `<image>` tokens, framed as Idefics3Processor writes them:

    <fake_token_around_image><row_1_col_1><image>*k ... (one line per row of crops)
    \\n<fake_token_around_image><global-img><image>*k<fake_token_around_image>

The forward takes `pixel_values` [batch, frames, 3, H, W] and `pixel_attention_mask`
[batch, frames, H, W]; it drops all-zero (padding) frames and fills the `<image>` tokens in
order, so one row holding every frame of the micro-batch is the same input as the
processor's per-sample rows. SmolVLM's processor writes the same text and the model tree is
the same (`vision_model`, `connector`, `text_model`). model.vision's image_min/max_pixels
do not apply: the saved processor's `size` (the longest edge before cutting) and
`max_image_size` (the crop) decide how many crops an image gets.
"""

from __future__ import annotations

import torch

from keel.models.vision.family import PreparedImage, VisionFamily

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE = "<global-img>"


def image_seq_len(config) -> int:
    """`<image>` tokens per crop: the tower's patches after the connector's pixel shuffle
    (what the processor's `image_seq_len` is set to)."""
    vision = config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor**2)


def image_text(rows: int, cols: int, seq_len: int) -> str:
    """The text of one image of rows x cols crops (0 x 0: the global view only)."""
    image_tokens = IMAGE_TOKEN * seq_len
    global_view = FAKE_TOKEN + GLOBAL_IMAGE + image_tokens + FAKE_TOKEN
    if rows == 0 and cols == 0:
        return global_view
    crop_lines = [
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image_tokens}" for c in range(cols))
        for r in range(rows)
    ]
    return "".join(line + "\n" for line in crop_lines) + "\n" + global_view


class Idefics3Family(VisionFamily):
    name = "idefics3"
    model_types = ("idefics3", "smolvlm")
    tower = ("model.vision_model",)
    projector = ("model.connector",)
    language_model = "model.text_model"
    image_token = IMAGE_TOKEN

    def prepare_images(self, image_processor, images: list, config) -> list[PreparedImage]:
        seq_len = image_seq_len(config)
        prepared = []
        for image in images:
            out = image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
            frames = out["pixel_values"][0]
            tensors = {"pixel_values": frames}
            if "pixel_attention_mask" in out:
                # bool in the cache (1 byte a pixel); model_inputs gives the processor's int64
                tensors["pixel_attention_mask"] = out["pixel_attention_mask"][0].bool()
            rows, cols = out["rows"][0][0], out["cols"][0][0]
            prepared.append(
                PreparedImage(
                    tensors=tensors,
                    text=image_text(rows, cols, seq_len),
                    num_tokens=seq_len * frames.shape[0],
                )
            )
        return prepared

    def model_inputs(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        frames = [image["pixel_values"] for image in images]
        height = max(f.shape[-2] for f in frames)
        width = max(f.shape[-1] for f in frames)
        count, channels = sum(f.shape[0] for f in frames), frames[0].shape[1]
        device = frames[0].device  # the micro-batch's images are on the model's device already
        pixels = torch.zeros(count, channels, height, width, dtype=frames[0].dtype, device=device)
        mask = torch.zeros(count, height, width, dtype=torch.long, device=device)
        start = 0
        for image, f in zip(images, frames):
            # frames of different sizes are zero-padded at the bottom/right, as the processor does
            end = start + f.shape[0]
            pixels[start:end, :, : f.shape[-2], : f.shape[-1]] = f
            own = image.get("pixel_attention_mask")
            mask[start:end, : f.shape[-2], : f.shape[-1]] = 1 if own is None else own.long()
            start = end
        return {"pixel_values": pixels[None], "pixel_attention_mask": mask[None]}


IDEFICS3 = Idefics3Family()
