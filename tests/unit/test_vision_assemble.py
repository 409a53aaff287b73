"""keel.models.vision.assemble: a LLaVA folder from a text model + a random CLIP tower."""

from __future__ import annotations

import pytest
import torch
from vlm_support import make_image

from keel.errors import ModelError
from keel.models.vision import family_of, vision_processing
from keel.models.vision.assemble import TowerShape, assemble_llava

TOWER = TowerShape(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, heads=2)


@pytest.fixture(scope="module")
def assembled(tiny_model_dir, tmp_path_factory):
    return assemble_llava(tiny_model_dir, tmp_path_factory.mktemp("asm") / "llava", TOWER)


def test_text_path_is_the_language_model_unchanged(assembled, tiny_model_dir):
    """Text-only logits equal the text model's on its vocabulary; the head stays tied."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    llava = AutoModelForImageTextToText.from_pretrained(str(assembled), dtype=torch.float32)
    text = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))("Who are you?", return_tensors="pt")
    with torch.no_grad():
        got = llava.eval()(input_ids=ids.input_ids).logits  # [1, T, V + 1]
        want = text.eval()(input_ids=ids.input_ids).logits  # [1, T, V]
    assert got.shape[-1] == want.shape[-1] + 1
    assert torch.equal(got[..., : want.shape[-1]], want)
    embeddings = llava.model.language_model.embed_tokens.weight
    assert llava.lm_head.weight.data_ptr() == embeddings.data_ptr()


def test_keel_reads_it_as_llava_with_the_tower_token_count(assembled):
    """keel's LLaVA plugin expands one image to (image_size / patch_size)^2 `<image>` tokens,
    as transformers' own LlavaProcessor from the folder does, and the config agrees."""
    from transformers import AutoProcessor

    processing = vision_processing(assembled, None, log=lambda _m: None)
    assert family_of(processing.model_config).name == "llava"
    (prepared,) = processing.prepare_images([make_image(0)])
    assert prepared.num_tokens == TOWER.image_tokens == 16
    assert processing.model_config.image_seq_length == TOWER.image_tokens
    processor = AutoProcessor.from_pretrained(str(assembled))
    expanded = processor(text=["<image>hi"], images=[make_image(0)], return_tensors="pt")
    image_id = processing.model_config.image_token_index
    assert int((expanded.input_ids == image_id).sum()) == TOWER.image_tokens
    assert torch.equal(expanded.pixel_values, prepared.tensors["pixel_values"])
    assert (assembled / "preprocessor_config.json").is_file()


def test_tower_and_projector_learn_from_an_image(assembled):
    """One forward with an image reaches every tower layer and the projector."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(assembled), dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(str(assembled))
    batch = processor(text=["<image>red"], images=[make_image(1)], return_tensors="pt")
    model(**batch, labels=batch.input_ids).loss.backward()
    for name in ("multi_modal_projector.linear_1", f"encoder.layers.{TOWER.layers - 1}.mlp.fc2"):
        grads = [p.grad for n, p in model.named_parameters() if name in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), name


def test_refuses_an_existing_folder_and_a_bad_shape(tiny_model_dir, tmp_path):
    with pytest.raises(ModelError, match="exists"):
        assemble_llava(tiny_model_dir, tmp_path, TOWER)
    bad = TowerShape(image_size=30, patch_size=8, hidden_size=15, heads=2)
    with pytest.raises(ModelError, match="multiple of patch_size.*multiple of heads"):
        assemble_llava(tiny_model_dir, tmp_path / "new", bad)
    assert not (tmp_path / "new").exists()
