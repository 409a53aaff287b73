"""`keel export` of a vision-language LoRA: the merged folder loads in transformers'
AutoModelForImageTextToText with its processor files and gives the adapter's logits."""

from __future__ import annotations

import pytest
import torch
from test_vision_models import hf_load, image_batch, keel_build, lora
from vlm_support import write_tiny_llava_dir, write_tiny_qwen2_vl_dir

from keel.config.schema import VisionConfig
from keel.export import ExportRequest, export_model
from keel.export.probe import probe_inputs
from keel.models.adapters import save_model_dir
from keel.models.loading import load_tokenizer


@pytest.mark.parametrize(
    "name, write, vision",
    [
        ("qwen2_vl", write_tiny_qwen2_vl_dir, VisionConfig()),
        ("llava", write_tiny_llava_dir, VisionConfig(freeze_projector=False)),
    ],
)
def test_export_merges_lora_into_a_folder_transformers_loads(name, write, vision, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    base = write(tmp_path / "base")
    model = keel_build(base, lora(), vision)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter (and projector): LoRA B starts at zero
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    model.eval()
    batch = image_batch(name, base)
    with torch.no_grad():
        want = model(**batch, use_cache=False).logits  # [1, T, V]
    save_model_dir(model, load_tokenizer(base), tmp_path / "adapter")

    out = export_model(
        ExportRequest(model=str(tmp_path / "adapter"), out=tmp_path / "merged"), log=lambda _: None
    )

    assert (out / "preprocessor_config.json").is_file()
    assert not (out / "adapter_config.json").exists()
    assert type(AutoImageProcessor.from_pretrained(str(out))).__name__.endswith("Pil")
    merged = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(**batch, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the tower was not adapted: the merged tower is the base's, tensor for tensor
    base_state = hf_load(base).state_dict()
    tower = [k for k in base_state if "visual.blocks" in k or "vision_tower" in k]
    assert tower and all(torch.equal(merged.state_dict()[k], base_state[k]) for k in tower)


@pytest.mark.parametrize("write", [write_tiny_qwen2_vl_dir, write_tiny_llava_dir])
def test_merge_probe_runs_an_image_through_a_vision_language_model(write, tmp_path):
    base = write(tmp_path / "base")
    model = hf_load(base).eval()
    probe = probe_inputs(model, base, load_tokenizer(base), log=lambda _: None)
    assert probe["pixel_values"].numel() > 0
    image_token = model.config.image_token_id
    assert (probe["input_ids"] == image_token).sum() > 0
    with torch.no_grad():
        logits = model(**probe, use_cache=False).logits  # [1, T, V]
    assert logits.shape[1] == probe["input_ids"].shape[1]
