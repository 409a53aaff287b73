"""Tiny Idefics3/SmolVLM, Gemma 3 and GLM-4V models for tests, built from configs offline.

The companions of tests/vlm_support.py (Qwen2-VL and LLaVA families): each `write_tiny_*_dir`
saves a complete model folder and returns its path; image sizes keep one image a few tokens.
"""

from __future__ import annotations

from pathlib import Path

from conftest import build_tiny_tokenizer
from vlm_support import TINY_TEXT, save_model_folder

# Idefics3/SmolVLM: SigLIP-like tower at 56x56, patch 14, pixel shuffle 2 -> 4 `<image>` tokens a
# crop; the processor resizes the longest edge to 112 and cuts 56x56 crops (2x2 + global view).
IDEFICS3_IMAGE_SIZE = 56
IDEFICS3_RESIZE_EDGE = 112
IDEFICS3_SEQ_LEN = 4
IDEFICS3_SPECIALS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
]
# Gemma 3: SigLIP at 56x56, patch 14 (4x4 patches) pooled to 2x2 = 4 soft tokens an image
GEMMA3_IMAGE_SIZE = 56
GEMMA3_TOKENS_PER_IMAGE = 4
GEMMA3_SPECIAL_NAMES = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
# GLM-4V: Qwen2-VL-like patches (14, merge 2): 4-16 image tokens for 56*56-112*112 pixels
GLM4V_SPECIALS = [
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
]
GLM4V_MIN_PIXELS = 56 * 56
GLM4V_MAX_PIXELS = 112 * 112


def build_idefics3_tokenizer():
    """The tiny ChatML tokenizer plus Idefics3's image specials and 6x6 crop-position tokens."""
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": IDEFICS3_SPECIALS})
    return tok


def idefics3_config(tokenizer, model_type: str = "idefics3"):
    from transformers import Idefics3Config, SmolVLMConfig

    config_class = SmolVLMConfig if model_type == "smolvlm" else Idefics3Config
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IDEFICS3_IMAGE_SIZE,
        patch_size=14,
    )
    return config_class(
        vision_config=vision,
        text_config=dict(TINY_TEXT, model_type="llama", vocab_size=len(tokenizer)),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )


def build_tiny_idefics3(tokenizer=None, seed: int = 0, model_type: str = "idefics3"):
    """A random Idefics3 (or SmolVLM: model_type="smolvlm"); ~165k parameters."""
    import torch
    from transformers import AutoModelForImageTextToText

    tokenizer = tokenizer or build_idefics3_tokenizer()
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(idefics3_config(tokenizer, model_type))


def build_idefics3_image_processor(model_type: str = "idefics3", **kwargs):
    from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil

    processor_class = (
        SmolVLMImageProcessorPil if model_type == "smolvlm" else Idefics3ImageProcessorPil
    )
    return processor_class(
        size={"longest_edge": IDEFICS3_RESIZE_EDGE},
        max_image_size={"longest_edge": IDEFICS3_IMAGE_SIZE},
        **kwargs,
    )


def build_gemma3_tokenizer():
    """The tiny ChatML tokenizer plus Gemma 3's image specials, named as Gemma's tokenizer
    names them (`tokenizer.boi_token`, `.image_token` ...: Gemma3Processor reads those)."""
    from transformers import PreTrainedTokenizerFast

    base = build_tiny_tokenizer()
    base.add_special_tokens({"additional_special_tokens": list(GEMMA3_SPECIAL_NAMES.values())})
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=base.unk_token,
        extra_special_tokens=GEMMA3_SPECIAL_NAMES,
    )
    tok.chat_template = base.chat_template
    return tok


def gemma3_config(tokenizer):
    from transformers import Gemma3Config

    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in GEMMA3_SPECIAL_NAMES.items()}
    text = dict(
        TINY_TEXT,
        vocab_size=len(tokenizer),
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=GEMMA3_IMAGE_SIZE,
        patch_size=14,
        vision_use_head=False,  # as released Gemma 3 checkpoints: the tower's pooling head unused
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )


def build_tiny_gemma3(tokenizer=None, seed: int = 0):
    """A random Gemma 3 (tiny SigLIP, 2 text layers: one sliding, one global); ~140k parameters."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    tokenizer = tokenizer or build_gemma3_tokenizer()
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(gemma3_config(tokenizer))
    # transformers initialises the projection into the text width to zeros: every image would
    # be the same all-zero features, and no test could tell images apart
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.05)
    return model


def build_gemma3_image_processor(**kwargs):
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(
        size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}, **kwargs
    )


def build_glm4v_tokenizer():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": GLM4V_SPECIALS})
    return tok


def glm4v_config(tokenizer):
    from transformers import Glm4vConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_SPECIALS}
    text = dict(
        TINY_TEXT,
        vocab_size=len(tokenizer),
        # rotary on half the head (16 / 2 = 8 dims); mrope_section sums to 8 / 2
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [1, 1, 2],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,  # downsample + merger project into the text hidden size
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        image_size=56,
    )
    return Glm4vConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )


def build_tiny_glm4v(tokenizer=None, seed: int = 0):
    """A random GLM-4V (2 vision blocks, 2 text layers; ~200k parameters)."""
    import torch
    from transformers import Glm4vForConditionalGeneration

    tokenizer = tokenizer or build_glm4v_tokenizer()
    torch.manual_seed(seed)
    return Glm4vForConditionalGeneration(glm4v_config(tokenizer))


def build_glm4v_image_processor():
    from transformers import Glm4vImageProcessorPil

    # GLM-4V's size bounds count both temporal patches of an image: twice the pixels
    return Glm4vImageProcessorPil(
        size={"shortest_edge": 2 * GLM4V_MIN_PIXELS, "longest_edge": 2 * GLM4V_MAX_PIXELS}
    )


def write_tiny_idefics3_dir(path: Path, seed: int = 0, model_type: str = "idefics3") -> Path:
    """A saved tiny Idefics3 (or SmolVLM) folder: model, tokenizer, image processor."""
    tokenizer = build_idefics3_tokenizer()
    model = build_tiny_idefics3(tokenizer, seed, model_type)
    return save_model_folder(path, model, tokenizer, build_idefics3_image_processor(model_type))


def write_tiny_gemma3_dir(path: Path, seed: int = 0) -> Path:
    """A saved tiny Gemma 3 folder: model, tokenizer, image processor."""
    tokenizer = build_gemma3_tokenizer()
    model = build_tiny_gemma3(tokenizer, seed)
    return save_model_folder(path, model, tokenizer, build_gemma3_image_processor())


def write_tiny_glm4v_dir(path: Path, seed: int = 0) -> Path:
    """A saved tiny GLM-4V folder: model, tokenizer, image processor."""
    tokenizer = build_glm4v_tokenizer()
    model = build_tiny_glm4v(tokenizer, seed)
    return save_model_folder(path, model, tokenizer, build_glm4v_image_processor())
