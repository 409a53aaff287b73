"""A vision-language model's share of the plan: its vision encoder and the image tokens.

keel keeps the vision tower and the projector REPLICATED on every rank (never inside an
FSDP unit: a frozen tower then runs no collective, a trainable one all-reduces its
gradients once per optimizer step), so the census marks their tensors `replicated` and the
estimate counts their weights, and when they train their gradients and AdamW state, whole
on every rank under every strategy.

Images per micro-batch: the plan reads no data, so it assumes one image per sequence
(`Workload.images_per_sequence`; the summary says so). Each image is taken at its
largest, `model.vision.image_max_pixels`:

- dynamic-resolution encoders (the vision config has `spatial_merge_size`: the Qwen2-VL
  family, GLM-4V): the image is cut into patch x patch squares, merge x merge of which
  become one token, so at most max_pixels / (patch x merge)^2 tokens and merge^2 patches
  per token;
- tiled encoders (`image_grid_pinpoints`: LLaVA-NeXT; `scale_factor`: Idefics3/SmolVLM):
  up to ceil(sqrt(max_pixels) / image_size)^2 tiles (LLaVA-NeXT: at most its largest
  pinpoint's) plus the downscaled overview, each a fixed-resolution image;
- fixed-resolution encoders (LLaVA-1.5, Gemma 3): every image is resized to image_size^2:
  (image_size / patch)^2 patches and the model's `image_seq_length` /
  `mm_tokens_per_image` tokens.

The image tokens sit inside the sequence (data.cutoff_len counts them), so the language
model's activations for them are the text estimate's. What the vision side adds, per
micro-batch (rough, stated; c bytes of the compute dtype):
- the pixels (fp32, patches x channels x temporal x patch^2 x 4), always;
- a training tower: per patch and encoder block, c x (8 w + 2 m) (w the encoder's width,
  m its MLP's: the norms' and linears' inputs, q/k/v, the attention output, the MLP's
  hidden twice), or under gradient checkpointing each block's input (c x w) plus one
  block's full set;
- a training projector (or tower): per image token, c x the projector's linears' inputs
  and hidden outputs, plus the features scattered into the embeddings (c x hidden).
A frozen tower and projector save nothing for backward (their forward runs before the
language model's activations build up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOWER = "tower"
PROJECTOR = "projector"
LANGUAGE = "lm"  # everything else: embeddings, decoder, output layer


@dataclass(frozen=True, kw_only=True)
class VisionShapes:
    """The vision encoder's sizes, from the model's vision config."""

    width: int  # the encoder's hidden size
    mlp: int  # its MLP's hidden size
    depth: int  # encoder blocks
    patch_dim: int  # pixel values per patch: channels x temporal x patch^2
    tokens_per_image: int  # image-feature tokens one image takes at most
    patches_per_image: int  # encoder positions for that image
    projector_width: int  # per image token: the projector's linears' inputs + hidden outputs

    @classmethod
    def of(cls, config, max_pixels: int, projector_width: int) -> VisionShapes:
        """From a vision-language `config` for images of at most `max_pixels` pixels."""
        vision = config.vision_config
        width = getattr(vision, "embed_dim", None) or vision.hidden_size
        ratio = getattr(vision, "mlp_ratio", None)
        mlp = getattr(vision, "intermediate_size", None) or int(width * (ratio or 4))
        depth = getattr(vision, "depth", None) or vision.num_hidden_layers
        patch = vision.patch_size
        channels = next(
            (
                getattr(vision, n)
                for n in ("in_chans", "in_channels", "num_channels")
                if getattr(vision, n, None)
            ),
            3,
        )
        temporal = getattr(vision, "temporal_patch_size", None) or 1
        tokens, patches = image_budget(config, max_pixels)
        return cls(
            width=width,
            mlp=mlp,
            depth=depth,
            patch_dim=channels * temporal * patch * patch,
            tokens_per_image=tokens,
            patches_per_image=patches,
            projector_width=projector_width,
        )


def image_budget(config, max_pixels: int) -> tuple[int, int]:
    """(image-feature tokens, encoder patches) of one image of at most `max_pixels` pixels
    (the module docstring gives the three kinds of encoder)."""
    vision = config.vision_config
    patch = vision.patch_size
    merge = getattr(vision, "spatial_merge_size", None)
    if merge:
        tokens = max(1, max_pixels // (patch * merge) ** 2)
        return tokens, tokens * merge * merge
    size = vision.image_size
    size = size if isinstance(size, int) else max(size)
    side = size // patch
    fixed_tokens = (
        getattr(config, "image_seq_length", None)
        or getattr(config, "mm_tokens_per_image", None)
        or _shuffled(side * side, getattr(config, "scale_factor", None))
    )
    tiles = _tiles(config, max_pixels, size)
    return tiles * fixed_tokens, tiles * side * side


def _shuffled(patches: int, scale_factor: int | None) -> int:
    """Idefics3's pixel shuffle folds scale_factor^2 patches into one token."""
    return patches // (scale_factor or 1) ** 2


def _tiles(config, max_pixels: int, size: int) -> int:
    """Fixed-resolution images one picture becomes: 1, or the tiles plus the overview."""
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if pinpoints is None and not getattr(config, "scale_factor", None):
        return 1
    per_side = math.ceil(math.sqrt(max_pixels) / size)
    tiles = per_side * per_side
    if pinpoints:  # LLaVA-NeXT resizes to one of its pinpoint resolutions
        tiles = min(tiles, max((h // size) * (w // size) for h, w in pinpoints))
    return tiles + 1


def image_assumption(shapes: VisionShapes, images_per_sequence: int, cutoff_len: int) -> str:
    """One line for the plan's summary: the images assumed and what one costs."""
    line = (
        f"images: {images_per_sequence} per sequence assumed (the plan reads no data), each "
        f"up to {shapes.tokens_per_image:,} tokens of data.cutoff_len and "
        f"{shapes.patches_per_image:,} encoder patches (model.vision.image_max_pixels)"
    )
    if shapes.tokens_per_image * images_per_sequence > cutoff_len:
        line += (
            f"; that many image tokens do not fit in data.cutoff_len {cutoff_len}: such rows "
            f"are dropped (never cut inside an image)"
        )
    return line


@dataclass(frozen=True, kw_only=True)
class VisionTraining:
    """What of the vision side trains (from the census) and how the step runs."""

    tower: bool
    projector: bool
    checkpointing: bool
    compute: int  # bytes per element of the compute dtype
    hidden: int  # the language model's hidden size


def vision_activation_bytes(shapes: VisionShapes, images: int, training: VisionTraining) -> int:
    """Bytes the vision side keeps for backward for `images` images (module docstring)."""
    patches = images * shapes.patches_per_image
    tokens = images * shapes.tokens_per_image
    c = training.compute
    total = patches * shapes.patch_dim * 4  # pixel_values, fp32
    if training.tower:
        block = c * (8 * shapes.width + 2 * shapes.mlp)  # per patch
        if training.checkpointing:
            total += patches * (shapes.depth * c * shapes.width + block)
        else:
            total += patches * shapes.depth * block
    if training.tower or training.projector:
        total += tokens * c * (shapes.projector_width + training.hidden)
    return total
