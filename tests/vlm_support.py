"""Tiny vision-language models for tests: Qwen2-VL and LLaVA-1.5, built from configs offline.

Each `write_tiny_*_dir` saves a complete model folder (weights, config, tokenizer with a chat
template, `preprocessor_config.json`) and returns its path. Image sizes are chosen so one test
image is a few image tokens: Qwen2-VL 4-16 (min 56*56, max 112*112 pixels), LLaVA 16 (56x56).
"""

from __future__ import annotations

from pathlib import Path

from conftest import build_tiny_tokenizer

QWEN2_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_IMAGE_TOKEN = "<image>"

# Qwen2-VL: patch 14, merge 2 -> one image token per 28x28 pixels
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 112 * 112
# LLaVA: CLIP at 56x56, patch 14 -> (56/14)^2 = 16 image tokens
LLAVA_IMAGE_SIZE = 56
LLAVA_PATCH_SIZE = 14
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2

TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_qwen2_vl_tokenizer():
    """The tests' tiny ChatML tokenizer plus Qwen2-VL's four vision specials (ids 320..323)."""
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN2_VL_SPECIALS})
    return tok


def build_llava_tokenizer():
    """The tests' tiny ChatML tokenizer plus LLaVA's `<image>` special (id 320)."""
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE_TOKEN]})
    return tok


def qwen2_vl_config(tokenizer):
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,  # the merger projects into the text hidden size
        num_heads=4,
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return Qwen2VLConfig(vision_config=vision, **_qwen_family_kwargs(tokenizer))


def build_tiny_qwen2_vl(tokenizer=None, seed: int = 0):
    """A random Qwen2-VL (2 text layers, 2 vision blocks; ~195k parameters)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = tokenizer or build_qwen2_vl_tokenizer()
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(qwen2_vl_config(tokenizer))


def build_qwen2_vl_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=QWEN2_VL_MIN_PIXELS, max_pixels=QWEN2_VL_MAX_PIXELS)


def llava_config(tokenizer, vision_feature_layer: int = -2):
    from transformers import LlavaConfig

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=LLAVA_PATCH_SIZE,
        projection_dim=32,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=dict(TINY_TEXT, model_type="llama", vocab_size=len(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        image_seq_length=LLAVA_IMAGE_TOKENS,
        vision_feature_select_strategy="default",
        vision_feature_layer=vision_feature_layer,
    )


def build_tiny_llava(tokenizer=None, seed: int = 0):
    """A random LLaVA-1.5 (tiny CLIP tower, 2-layer Llama; ~158k parameters)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    tokenizer = tokenizer or build_llava_tokenizer()
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(llava_config(tokenizer))


def build_llava_image_processor():
    from transformers import LlavaImageProcessorPil

    return LlavaImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    )


def save_model_folder(path: Path, model, tokenizer, image_processor) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)  # preprocessor_config.json
    return path


def write_tiny_qwen2_vl_dir(path: Path, seed: int = 0) -> Path:
    """A saved tiny Qwen2-VL folder (model, tokenizer with chat template, image processor)."""
    tokenizer = build_qwen2_vl_tokenizer()
    model = build_tiny_qwen2_vl(tokenizer, seed)
    return save_model_folder(path, model, tokenizer, build_qwen2_vl_image_processor())


def write_tiny_llava_dir(path: Path, seed: int = 0) -> Path:
    """A saved tiny LLaVA-1.5 folder (model, tokenizer with chat template, image processor)."""
    tokenizer = build_llava_tokenizer()
    model = build_tiny_llava(tokenizer, seed)
    return save_model_folder(path, model, tokenizer, build_llava_image_processor())


def make_image(seed: int, size: tuple[int, int] = (80, 100), colour=None):
    """An RGB PIL image of `size` (width, height): random noise, or one flat `colour` (r, g, b)."""
    import numpy as np
    from PIL import Image

    width, height = size
    if colour is not None:
        return Image.new("RGB", (width, height), tuple(colour))
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def write_image(path: Path, seed: int = 0, size: tuple[int, int] = (80, 100), colour=None) -> Path:
    """Save `make_image(...)` to `path` (format from the suffix: .png, .jpg ...); returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image(seed, size, colour).save(path)
    return path


def write_images(folder: Path, count: int, size: tuple[int, int] = (80, 100)) -> list[Path]:
    """`count` different PNG images in `folder` (img0.png, img1.png, ...)."""
    return [write_image(Path(folder) / f"img{i}.png", seed=i, size=size) for i in range(count)]


def _qwen_family_kwargs(tokenizer) -> dict:
    """Text config and special token ids shared by the tiny Qwen2/2.5/3-VL models."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIALS}
    text = dict(
        TINY_TEXT,
        vocab_size=len(tokenizer),
        # mrope_section sums to head_dim / 2 = 64 / 4 / 2
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    return dict(
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def build_tiny_qwen2_5_vl(tokenizer=None, seed: int = 0):
    """A random Qwen2.5-VL (window attention in block 0, full attention in block 1)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    kwargs = _qwen_family_kwargs(tokenizer or build_qwen2_vl_tokenizer())
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, **kwargs))


def build_tiny_qwen3_vl(tokenizer=None, seed: int = 0):
    """A random Qwen3-VL (patch 14 so the Qwen2-VL test processor fits; DeepStack at block 0)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    kwargs = _qwen_family_kwargs(tokenizer or build_qwen2_vl_tokenizer())
    kwargs["text_config"] = dict(kwargs["text_config"], head_dim=16)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=vision, **kwargs))


# LLaVA-NeXT: 28x28 crops (4 patches of 14), tiles on a grid of up to 2x2 crops
LLAVA_NEXT_CROP = 28
LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def llava_next_config(tokenizer):
    from transformers import LlavaNextConfig

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=LLAVA_NEXT_CROP,
        patch_size=LLAVA_PATCH_SIZE,
        projection_dim=32,
    )
    return LlavaNextConfig(
        vision_config=vision,
        text_config=dict(TINY_TEXT, model_type="llama", vocab_size=len(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )


def build_tiny_llava_next(tokenizer=None, seed: int = 0):
    import torch
    from transformers import LlavaNextForConditionalGeneration

    tokenizer = tokenizer or build_llava_tokenizer()
    torch.manual_seed(seed)
    return LlavaNextForConditionalGeneration(llava_next_config(tokenizer))


def build_llava_next_image_processor():
    from transformers import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(
        size={"shortest_edge": LLAVA_NEXT_CROP},
        crop_size={"height": LLAVA_NEXT_CROP, "width": LLAVA_NEXT_CROP},
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
    )


def write_tiny_llava_next_dir(path: Path, seed: int = 0) -> Path:
    """A saved tiny LLaVA-NeXT folder (model, tokenizer with chat template, image processor)."""
    tokenizer = build_llava_tokenizer()
    model = build_tiny_llava_next(tokenizer, seed)
    return save_model_folder(path, model, tokenizer, build_llava_next_image_processor())


def write_colour_dataset(folder: Path) -> Path:
    """colours.json in `folder`: four rows asking the colour of a flat-coloured image (with
    the images beside it) and two text-only rows, in LLaMA-Factory's `messages` + `images`
    form."""
    import json

    folder = Path(folder)
    coloured = [("red", (220, 30, 30)), ("green", (30, 200, 30)), ("blue", (30, 30, 220))]
    rows = []
    for index, (name, rgb) in enumerate([*coloured, ("red", (200, 40, 40))]):
        image = write_image(folder / f"img{index}.png", seed=index, colour=rgb)
        messages = [
            {"role": "user", "content": "<image>What colour is this?"},
            {"role": "assistant", "content": f"It is {name}."},
        ]
        rows.append({"messages": messages, "images": [str(image)]})
    for question, answer in [("Say hi.", "Hi."), ("Count to two.", "One, two.")]:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "images": []})
    path = folder / "colours.json"
    path.write_text(json.dumps(rows))
    return path
