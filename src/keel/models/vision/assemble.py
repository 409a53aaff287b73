"""Assemble a LLaVA model from a text model and a new, randomly initialised vision tower.

This is LLaVA's recipe before its alignment stage: a pretrained language model, a vision
encoder (here a small CLIP vision transformer, random: no vision weights are needed) and a
fresh two-layer projector from the encoder's width into the language model's embeddings.
The result is an ordinary `LlavaForConditionalGeneration` folder (weights, config.json,
tokenizer with an added `<image>` token, chat template, a CLIP image processor config) that
keel, and transformers' `AutoModelForImageTextToText` / `AutoProcessor`, load like any LLaVA
checkpoint. Training it (tower and projector trainable) is LLaVA's alignment stage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.errors import ModelError
from keel.models.vision.family import PLACEHOLDER


@dataclass(frozen=True, kw_only=True)
class TowerShape:
    """The random CLIP vision tower: square images of `image_size` pixels cut into
    `patch_size` patches, so each image fills (image_size / patch_size)² tokens."""

    image_size: int = 64
    patch_size: int = 16
    hidden_size: int = 128
    intermediate_size: int = 256
    layers: int = 2
    heads: int = 4
    seed: int = 0  # seeds the tower's and the projector's initial weights

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def problems(self) -> list[str]:
        """What is wrong with these numbers, each with the fix ([] when nothing)."""
        found = []
        if self.patch_size < 1 or self.image_size % self.patch_size:
            found.append(
                f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}"
            )
        if self.heads < 1 or self.hidden_size % self.heads:
            found.append(f"hidden_size {self.hidden_size} must be a multiple of heads {self.heads}")
        if self.layers < 1:
            found.append(f"layers must be at least 1, got {self.layers}")
        return found


def assemble_llava(language_dir: Path, out_dir: Path, tower: TowerShape) -> Path:
    """Write a LLaVA folder at `out_dir`: the text model of `language_dir` (a Hugging Face
    causal-LM folder with its tokenizer) + a random CLIP tower shaped by `tower` + a fresh
    projector. The language model's weights are copied unchanged; its embeddings gain one
    row for `<image>`. Raises ModelError when `out_dir` exists or `tower` is inconsistent.
    Written beside `out_dir` and renamed at the end, so a crash leaves nothing half-written.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tower.problems():
        raise ModelError("vision tower: " + "; ".join(tower.problems()))
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ModelError(f"{out_dir} exists; give a new folder (or delete it) to assemble into")
    tokenizer = AutoTokenizer.from_pretrained(str(language_dir))
    text_model = AutoModelForCausalLM.from_pretrained(str(language_dir), dtype=torch.float32)
    image_token_id = _add_image_token(tokenizer, text_model)
    model = _llava_model(text_model, tower, image_token_id)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model folder is readable like any other
    try:
        model.save_pretrained(str(tmp))
        processor = _processor(tokenizer, tower)
        processor.save_pretrained(str(tmp))
        # Also on its own, as hub LLaVA folders have it: readers that want only the image
        # processor (AutoImageProcessor, older transformers) look for this file.
        processor.image_processor.save_pretrained(str(tmp))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _add_image_token(tokenizer, text_model) -> int:
    """Add `<image>` as a special token (never split, never produced from text) and give
    the model an embedding row for it; returns its id."""
    from tokenizers import AddedToken

    if PLACEHOLDER in tokenizer.get_vocab():
        raise ModelError(f"the text model's tokenizer already has {PLACEHOLDER!r}")
    tokenizer.add_tokens([AddedToken(PLACEHOLDER, special=True, normalized=False)])
    # Rows the image features replace at every use: their initial value never matters.
    text_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return tokenizer.convert_tokens_to_ids(PLACEHOLDER)


def _llava_model(text_model, tower: TowerShape, image_token_id: int):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision_config = CLIPVisionConfig(
        hidden_size=tower.hidden_size,
        intermediate_size=tower.intermediate_size,
        num_hidden_layers=tower.layers,
        num_attention_heads=tower.heads,
        image_size=tower.image_size,
        patch_size=tower.patch_size,
        projection_dim=tower.hidden_size,
    )
    config = LlavaConfig(
        vision_config=vision_config.to_dict(),
        text_config=text_model.config.to_dict(),
        image_token_index=image_token_id,
        image_seq_length=tower.image_tokens,
        # The last layer's features (LLaVA-1.5 takes the second-to-last, which leaves the
        # last layer without gradients: pointless for a tower trained from scratch) without
        # the CLS token ("default"), so an image is exactly image_tokens tokens.
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=text_model.config.tie_word_embeddings,
    )
    torch.manual_seed(tower.seed)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.tie_weights()
    model.generation_config = text_model.generation_config
    return model.eval()


def _processor(tokenizer, tower: TowerShape):
    """LLaVA's processor: the tokenizer (with its chat template) and a PIL CLIP image
    processor that resizes and centre-crops to the tower's square."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": tower.image_size},
        crop_size={"height": tower.image_size, "width": tower.image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=tower.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, which "default" drops again
        image_token=PLACEHOLDER,
        chat_template=tokenizer.chat_template,
    )
