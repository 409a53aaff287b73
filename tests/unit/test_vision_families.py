"""Vision family plugins (Qwen2-VL family, LLaVA 1.5/NeXT) against transformers' own
processors and models: same input ids, a working forward and backward, same M-RoPE positions;
image references, the processor fallback, the registry and blobs."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
import vlm_support as vlm

from keel.errors import ImageError, ModelError
from keel.models.vision import (
    PLACEHOLDER,
    blobs,
    family_of,
    images,
    is_vision_model_dir,
    vision_processing,
)
from keel.models.vision.llava import LLAVA, LLAVA_NEXT
from keel.models.vision.qwen2_vl import QWEN2_5_VL, QWEN2_VL, QWEN3_VL

PROMPT = f"look {PLACEHOLDER} and {PLACEHOLDER} what?"
TWO_IMAGES = [vlm.make_image(0, (80, 100)), vlm.make_image(1, (120, 60))]


def _expand(prompt: str, prepared) -> str:
    """The rendered text with each placeholder replaced by its image's text, in order."""
    pieces = prompt.split(PLACEHOLDER)
    assert len(pieces) == len(prepared) + 1
    return pieces[0] + "".join(p.text + rest for p, rest in zip(prepared, pieces[1:]))


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def _image_only_qwen2_vl_processor(image_processor, tokenizer):
    """Qwen2VLProcessor without its video processor (which needs torchvision)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _forward_backward(model, input_ids, family, prepared):
    inputs = family.model_inputs([p.tensors for p in prepared])
    inputs.update(family.token_inputs(input_ids, model.config))
    labels = input_ids.masked_fill(input_ids == model.config.image_token_id, -100)
    out = model(input_ids=input_ids, labels=labels, **inputs)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    return {name for name, p in model.named_parameters() if p.grad is None}


def test_qwen2_vl_expansion_matches_the_processor_and_trains():
    tokenizer = vlm.build_qwen2_vl_tokenizer()
    processor = vlm.build_qwen2_vl_image_processor()
    model = vlm.build_tiny_qwen2_vl(tokenizer)
    prepared = QWEN2_VL.prepare_images(processor, TWO_IMAGES, model.config)
    assert [p.num_tokens for p in prepared] == [12, 8]  # 8x6 and 4x8 merged grids ... /4
    ids = _ids(tokenizer, _expand(PROMPT, prepared))

    hf_text = PROMPT.replace(PLACEHOLDER, "<|vision_start|><|image_pad|><|vision_end|>")
    reference = _image_only_qwen2_vl_processor(processor, tokenizer)
    expected = reference(text=[hf_text], images=TWO_IMAGES, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"])
    tokens = QWEN2_VL.token_inputs(ids, model.config)
    assert torch.equal(tokens["mm_token_type_ids"], expected["mm_token_type_ids"].long())
    inputs = QWEN2_VL.model_inputs([p.tensors for p in prepared])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])

    assert not _forward_backward(model, ids, QWEN2_VL, prepared)  # every parameter learns
    assert QWEN2_VL.model_inputs([]) == {}


@pytest.mark.parametrize(
    "family, build",
    [
        (QWEN2_VL, vlm.build_tiny_qwen2_vl),
        (QWEN2_5_VL, vlm.build_tiny_qwen2_5_vl),
        (QWEN3_VL, vlm.build_tiny_qwen3_vl),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
def test_qwen_rope_positions_equal_get_rope_index(family, build):
    tokenizer = vlm.build_qwen2_vl_tokenizer()
    processor = vlm.build_qwen2_vl_image_processor()
    model = build(tokenizer)
    assert family_of(model.config) is family
    samples = [
        (PROMPT, TWO_IMAGES),
        (f"{PLACEHOLDER} first", TWO_IMAGES[1:]),
        (f"only text {PLACEHOLDER}", TWO_IMAGES[:1]),
        ("no image at all", []),
    ]
    for prompt, sample_images in samples:
        prepared = family.prepare_images(processor, sample_images, model.config)
        ids = _ids(tokenizer, _expand(prompt, prepared))
        tensors = [p.tensors for p in prepared]
        ours = family.rope_positions(ids[0].tolist(), tensors, model.config)
        grids = family.model_inputs(tensors).get("image_grid_thw")
        mm = family.token_inputs(ids, model.config)["mm_token_type_ids"]
        theirs, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grids)
        assert torch.equal(ours, theirs[:, 0]), prompt
    # every parameter of the other two families gets a gradient too (DeepStack included)
    prepared = family.prepare_images(processor, TWO_IMAGES, model.config)
    assert not _forward_backward(
        model, _ids(tokenizer, _expand(PROMPT, prepared)), family, prepared
    )


def test_qwen_module_paths_cover_the_vision_model():
    for family, build in [(QWEN2_VL, vlm.build_tiny_qwen2_vl), (QWEN3_VL, vlm.build_tiny_qwen3_vl)]:
        names = [name for name, _ in build().named_parameters()]
        listed = family.tower + family.projector
        visual = [n for n in names if n.startswith("model.visual.")]
        assert visual and all(n.startswith(listed) for n in visual)
        assert any(n.startswith(family.projector) for n in visual)
        assert any(n.startswith(family.language_model) for n in names)


def test_llava_expansion_matches_the_processor_and_unused_params_get_no_grad():
    from transformers import LlavaProcessor

    tokenizer = vlm.build_llava_tokenizer()
    processor = vlm.build_llava_image_processor()
    model = vlm.build_tiny_llava(tokenizer)
    prepared = LLAVA.prepare_images(processor, TWO_IMAGES, model.config)
    assert [p.num_tokens for p in prepared] == [vlm.LLAVA_IMAGE_TOKENS] * 2
    ids = _ids(tokenizer, _expand(PROMPT, prepared))
    reference = LlavaProcessor(
        image_processor=processor,
        tokenizer=tokenizer,
        patch_size=vlm.LLAVA_PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    expected = reference(text=[PROMPT], images=TWO_IMAGES, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"])
    inputs = LLAVA.model_inputs([p.tensors for p in prepared])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])

    no_grad = _forward_backward(model, ids, LLAVA, prepared)
    unused = LLAVA.unused_parameters(model.config)
    assert unused == ("model.vision_tower.encoder.layers.1", "model.vision_tower.post_layernorm")
    assert no_grad == {n for n, _ in model.named_parameters() if n.startswith(unused)}
    assert all(
        n.startswith(LLAVA.tower + LLAVA.projector + ("model.language_model", "lm_head"))
        for n, _ in model.named_parameters()
    )


def test_llava_next_anyres_token_counts_match_the_processor():
    from transformers import LlavaNextProcessor

    tokenizer = vlm.build_llava_tokenizer()
    processor = vlm.build_llava_next_image_processor()
    model = vlm.build_tiny_llava_next(tokenizer)
    # a tall, a wide and a square image: different tile grids and unpadding
    sample = TWO_IMAGES + [vlm.make_image(2, (64, 64))]
    prompt = PROMPT + f" {PLACEHOLDER}"
    prepared = LLAVA_NEXT.prepare_images(processor, sample, model.config)
    ids = _ids(tokenizer, _expand(prompt, prepared))
    reference = LlavaNextProcessor(
        image_processor=processor,
        tokenizer=tokenizer,
        patch_size=vlm.LLAVA_PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    expected = reference(text=[prompt], images=sample, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"])
    inputs = LLAVA_NEXT.model_inputs([p.tensors for p in prepared])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])  # padded as HF pads
    assert torch.equal(inputs["image_sizes"], expected["image_sizes"])

    no_grad = _forward_backward(model, ids, LLAVA_NEXT, prepared)
    unused = LLAVA_NEXT.unused_parameters(model.config)
    assert no_grad == {n for n, _ in model.named_parameters() if n.startswith(unused)}
    assert "model.image_newline" in dict(model.named_parameters())


def test_vision_processing_loads_the_folder_and_says_which_processor_once(tmp_path):
    from types import SimpleNamespace

    folder = vlm.write_tiny_qwen2_vl_dir(tmp_path / "qwen")
    settings = SimpleNamespace(
        freeze_tower=True, freeze_projector=True, image_max_pixels=56 * 56, image_min_pixels=28 * 28
    )
    lines = []
    vision = vision_processing(folder, settings, log=lines.append)
    assert vision.family is QWEN2_VL and vision.model_config.model_type == "qwen2_vl"
    assert type(vision.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert len(lines) == 1 and "Qwen2VLImageProcessor" in lines[0] and "Pil" in lines[0]
    # the settings' bound wins over the folder's 112*112 (12 tokens for this image)
    (image,) = vision.prepare_images([vlm.make_image(0, (80, 100))])
    assert int(image.tensors["image_grid_thw"].prod()) * 14 * 14 <= 56 * 56
    assert image.num_tokens == 2

    # a hub folder: the legacy "Fast" name, and min/max_pixels keys that would replace `size`
    config_file = folder / "preprocessor_config.json"
    saved = json.loads(config_file.read_text())
    saved.update(image_processor_type="Qwen2VLImageProcessorFast", min_pixels=3136, max_pixels=1e7)
    config_file.write_text(json.dumps(saved))
    hub = vision_processing(folder, settings, log=lines.append)
    assert len(lines) == 2 and "Qwen2VLImageProcessorFast" in lines[1]
    assert hub.prepare_images([vlm.make_image(0, (80, 100))])[0].num_tokens == 2
    lines.clear()

    text_dir = tmp_path / "text"
    text_dir.mkdir()
    (text_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert vision_processing(text_dir, settings, log=lines.append) is None
    assert is_vision_model_dir(folder) and not is_vision_model_dir(text_dir)
    assert not lines


def test_family_of_text_models_and_refusals():
    assert family_of({"model_type": "llama"}) is None
    assert family_of({"model_type": "llava_next"}) is LLAVA_NEXT
    with pytest.raises(ModelError, match="GLM-4V"):
        family_of({"model_type": "cogvlm", "architectures": ["CogVLMForCausalLM"]})


def _png_bytes(size=(20, 10)) -> bytes:
    buffer = io.BytesIO()
    vlm.make_image(3, size).save(buffer, format="PNG")
    return buffer.getvalue()


def test_load_image_accepts_every_reference_kind(tmp_path):
    path = vlm.write_image(tmp_path / "pics" / "a.png", size=(20, 10))
    data = _png_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    refs = [
        "pics/a.png",
        str(path),
        path.as_uri(),
        url,
        data,
        {"bytes": data, "path": None},
        {"path": str(path)},
        vlm.make_image(3, (20, 10)).convert("L"),
    ]
    for ref in refs:
        image = images.load_image(ref, base_dir=tmp_path)
        assert image.mode == "RGB" and image.size == (20, 10), ref


def test_load_image_refuses_bad_references_naming_them(tmp_path, monkeypatch):
    with pytest.raises(ImageError, match="missing.png"):
        images.load_image("missing.png", base_dir=tmp_path)
    with pytest.raises(ImageError, match="garbage"):
        images.load_image(_write(tmp_path / "garbage.jpg", b"not an image"))
    with pytest.raises(ImageError, match="base64"):
        images.load_image("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="http"):
        images.load_image("http://example.com/a.png")
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="20x10 pixels"):
        images.load_image(_png_bytes())
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(ImageError, match="byte limit"):
        images.load_image(vlm.write_image(tmp_path / "big.png"))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_blobs_round_trip_exactly():
    tensors = {
        "pixel_values": torch.randn(12, 1176),
        "image_grid_thw": torch.tensor([[1, 6, 8]]),
    }
    back = blobs.unpack(blobs.pack(tensors))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype for k in back)
