"""Idefics3/SmolVLM, Gemma 3 and GLM-4V plugins against transformers' own processors and models.

For each family: keel's placeholder expansion, tokenized, equals the HF processor's input_ids;
`model_inputs` + `token_inputs` give the tensors the processor gives and feed a forward and a
backward; GLM-4V's per-sample positions equal the model's `get_rope_index`; the module paths
exist and cover every vision parameter. CogVLM is refused naming GLM-4V.
"""

from __future__ import annotations

import pytest
import torch
import vlm_support as vs
import vlm_support_more as vsm
from transformers import Gemma3Processor, Glm4vProcessor, Idefics3Processor, SmolVLMProcessor
from transformers.processing_utils import ProcessorMixin

from keel.errors import ModelError
from keel.models.vision import PLACEHOLDER, family_of, vision_processing
from keel.models.vision.gemma3 import GEMMA3
from keel.models.vision.glm4v import GLM4V
from keel.models.vision.idefics3 import IDEFICS3

PROMPT = f"hi {PLACEHOLDER} and {PLACEHOLDER} what colour?"
ANSWER_TOKENS = 3  # the loss is on the last few tokens: they come after both images


def _images():
    # a tall image and a small wide one: different crops / grids
    return [vs.make_image(0, (80, 100)), vs.make_image(1, (60, 30))]


def _expand(prompt: str, prepared) -> str:
    """The prompt with each placeholder replaced by its image's text, left to right (the image
    text may itself hold `<image>`: Idefics3's image token is the placeholder)."""
    pieces = prompt.split(PLACEHOLDER)
    assert len(pieces) == len(prepared) + 1
    return pieces[0] + "".join(p.text + rest for p, rest in zip(prepared, pieces[1:]))


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def _labels(input_ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(input_ids, -100)
    labels[:, -ANSWER_TOKENS:] = input_ids[:, -ANSWER_TOKENS:]
    return labels


def _train_step(model, input_ids, kwargs) -> torch.Tensor:
    model.zero_grad()
    out = model(input_ids=input_ids, labels=_labels(input_ids), use_cache=False, **kwargs)
    out.loss.backward()
    return out.loss.detach()


def _assert_paths_cover_vision(model, family, config):
    """Tower, projector and language model exist; every parameter outside the language model
    and the head is in the tower or the projector; the vision paths get gradients."""
    vision = family.tower + family.projector
    for path in (*vision, family.language_model):
        model.get_submodule(path)
    outside = [
        name
        for name, _ in model.named_parameters()
        if not name.startswith((family.language_model + ".", "lm_head."))
    ]
    assert outside
    uncovered = [n for n in outside if not n.startswith(tuple(p + "." for p in vision))]
    assert uncovered == []
    unused = tuple(p + "." for p in family.unused_parameters(config))
    params = dict(model.named_parameters())
    without_grad = [n for n in outside if params[n].grad is None and not n.startswith(unused)]
    assert without_grad == []
    for path in family.projector:
        assert not path.startswith(family.tower)  # disjoint: freezing one keeps the other


# ---- Idefics3 / SmolVLM ---------------------------------------------------------------------


class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
    """SmolVLMProcessor needs num2words and a video processor (torchvision); images need
    neither (ProcessorMixin reads its parts from this __init__'s parameters)."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_len=169, **kw):
        self.fake_image_token = "<fake_token_around_image>"
        self.image_token = "<image>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.end_of_utterance_token = "<end_of_utterance>"
        self.global_image_token = "<global-img>"
        self.image_seq_len = image_seq_len
        self.video_token = "<video>"
        ProcessorMixin.__init__(self, image_processor, tokenizer)


def _idefics3_processor(model_type, image_processor, tokenizer):
    if model_type == "smolvlm":
        return ImageOnlySmolVLMProcessor(image_processor, tokenizer, vsm.IDEFICS3_SEQ_LEN)
    return Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=vsm.IDEFICS3_SEQ_LEN
    )


@pytest.mark.parametrize("model_type", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("splitting", [True, False])
def test_idefics3_expansion_and_inputs_equal_the_processor(model_type, splitting):
    tok = vsm.build_idefics3_tokenizer()
    config = vsm.idefics3_config(tok, model_type)
    ip = vsm.build_idefics3_image_processor(model_type, do_image_splitting=splitting)
    assert family_of(config) is IDEFICS3
    prepared = IDEFICS3.prepare_images(ip, _images(), config)
    # 2x2 and 1x2 crops + the global view each, or the global view alone
    frames = [5, 3] if splitting else [1, 1]
    assert [p.num_tokens for p in prepared] == [f * vsm.IDEFICS3_SEQ_LEN for f in frames]

    processor = _idefics3_processor(model_type, ip, tok)
    ref = processor(text=[PROMPT], images=[_images()], return_tensors="pt")
    ours = IDEFICS3.model_inputs([p.tensors for p in prepared])
    assert torch.equal(_ids(tok, _expand(PROMPT, prepared)), ref["input_ids"])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours["pixel_attention_mask"], ref["pixel_attention_mask"])
    assert ours["pixel_attention_mask"].dtype == ref["pixel_attention_mask"].dtype
    assert IDEFICS3.token_inputs(ref["input_ids"], config) == {}
    on_meta = IDEFICS3.model_inputs(
        [{k: v.to("meta") for k, v in p.tensors.items()} for p in prepared]
    )
    assert {t.device.type for t in on_meta.values()} == {"meta"}  # stays on the images' device


@pytest.mark.parametrize("model_type", ["idefics3", "smolvlm"])
def test_idefics3_micro_batch_forward_backward(model_type):
    """Two samples (1 and 2 images): our one row of frames gives the processor's padded
    [samples, max images] batch's logits; a training step reaches every vision parameter."""
    tok = vsm.build_idefics3_tokenizer()
    model = vsm.build_tiny_idefics3(tok, model_type=model_type)
    ip = vsm.build_idefics3_image_processor(model_type)
    texts = [f"a {PLACEHOLDER} b", PROMPT]
    images = [[_images()[1]], _images()]
    prepared = [IDEFICS3.prepare_images(ip, imgs, model.config) for imgs in images]
    ref = _idefics3_processor(model_type, ip, tok)(
        text=texts, images=images, return_tensors="pt", padding=True
    )
    assert ref["pixel_values"].shape[:2] == (2, 8)  # sample 0: 3 frames and 5 zero frames
    ours = IDEFICS3.model_inputs([p.tensors for sample in prepared for p in sample])
    assert ours["pixel_values"].shape[:2] == (1, 11)
    ids = ref["input_ids"]
    for row, (text, sample) in enumerate(zip(texts, prepared)):
        own = _ids(tok, _expand(text, sample))[0]
        assert torch.equal(ids[row][ref["attention_mask"][row].bool()], own)
    model.eval()
    with torch.no_grad():
        want = model(**ref).logits
        got = model(input_ids=ids, attention_mask=ref["attention_mask"], **ours).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    model.train()
    loss = _train_step(model, ids[1:], IDEFICS3.model_inputs([p.tensors for p in prepared[1]]))
    assert torch.isfinite(loss)
    _assert_paths_cover_vision(model, IDEFICS3, model.config)


# ---- Gemma 3 --------------------------------------------------------------------------------


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_gemma3_expansion_and_inputs_equal_the_processor(pan_and_scan):
    tok = vsm.build_gemma3_tokenizer()
    config = vsm.gemma3_config(tok)
    options = {"pan_and_scan_min_crop_size": 16} if pan_and_scan else {}
    ip = vsm.build_gemma3_image_processor(do_pan_and_scan=pan_and_scan, **options)
    assert family_of(config) is GEMMA3
    prepared = GEMMA3.prepare_images(ip, _images(), config)
    processor = Gemma3Processor(
        image_processor=ip, tokenizer=tok, image_seq_length=vsm.GEMMA3_TOKENS_PER_IMAGE
    )
    # Gemma's chat template writes <start_of_image> where the user's image goes
    ref = processor(
        text=[PROMPT.replace(PLACEHOLDER, tok.boi_token)],
        images=[_images()],
        return_tensors="pt",
        do_pan_and_scan=pan_and_scan,
        **options,
    )
    ids = _ids(tok, _expand(PROMPT, prepared))
    assert torch.equal(ids, ref["input_ids"])
    assert torch.equal(GEMMA3.token_inputs(ids, config)["token_type_ids"], ref["token_type_ids"])
    ours = GEMMA3.model_inputs([p.tensors for p in prepared])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    crops = 2 if pan_and_scan else 0  # the 80x100 and 60x30 images each get two crops
    assert sum(p.num_tokens for p in prepared) == vsm.GEMMA3_TOKENS_PER_IMAGE * (2 + 2 * crops)


def test_gemma3_forward_backward_needs_token_type_ids():
    tok = vsm.build_gemma3_tokenizer()
    model = vsm.build_tiny_gemma3(tok)
    prepared = GEMMA3.prepare_images(vsm.build_gemma3_image_processor(), _images(), model.config)
    ids = _ids(tok, _expand(PROMPT, prepared))
    kwargs = {
        **GEMMA3.model_inputs([p.tensors for p in prepared]),
        **GEMMA3.token_inputs(ids, model.config),
    }
    model.train()
    loss = _train_step(model, ids, kwargs)
    assert torch.isfinite(loss)
    _assert_paths_cover_vision(model, GEMMA3, model.config)
    # the bidirectional image attention is what token_type_ids switch on: it changes the loss
    causal = {k: v for k, v in kwargs.items() if k != "token_type_ids"}
    assert _train_step(model, ids, causal) != loss
    # a text-only micro-batch: all-zero token_type_ids leave the causal model as it is
    text = _ids(tok, "hi there, what colour?")
    assert GEMMA3.model_inputs([]) == {}
    with_types = _train_step(model, text, GEMMA3.token_inputs(text, model.config))
    assert torch.equal(with_types, _train_step(model, text, {}))


def test_gemma3_keeps_padded_rows_since_varlen_attention_is_causal():
    """keel's varlen attention would silently make Gemma 3's image attention causal: the
    objective's check refuses it (the run keeps right-padded micro-batches)."""
    from keel.train.objective import CausalLMObjective

    model = vsm.build_tiny_gemma3()
    ok, why = CausalLMObjective(model, vision=GEMMA3).check_varlen_attention()
    assert not ok and "gemma3" in why and "both ways" in why
    assert (IDEFICS3.image_attention, GLM4V.image_attention) == ("causal", "causal")


def test_gemma3_packing_is_refused_before_training(tmp_path):
    """Packed rows would get the wrong image attention in Gemma 3's sliding-window layers
    (transformers 5.24): `keel train` refuses data.packing, exit 2, naming the fix."""
    import json

    import yaml
    from cli_support import keel_in_process

    folder = vsm.write_tiny_gemma3_dir(tmp_path / "gemma3")
    image = vs.write_image(tmp_path / "img.png")
    rows = [{"messages": [{"role": "user", "content": "<image>Hi"}], "images": [str(image)]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    config = {
        "model": {"path": str(folder)},
        "method": {"type": "full"},
        "data": {"datasets": [str(tmp_path / "d.json")], "packing": True},
        "train": {"max_steps": 1, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    done = keel_in_process("train", str(tmp_path / "run.yaml"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "data.packing" in done.stderr and "gemma3" in done.stderr


def test_gemma3_pooling_head_is_unused_when_kept():
    tok = vsm.build_gemma3_tokenizer()
    config = vsm.gemma3_config(tok)
    assert GEMMA3.unused_parameters(config) == ()
    config.vision_config.vision_use_head = True
    assert GEMMA3.unused_parameters(config) == ("model.vision_tower.head",)


# ---- GLM-4V ---------------------------------------------------------------------------------


class ImageOnlyGlm4vProcessor(Glm4vProcessor):
    """Glm4vProcessor needs a video processor (torchvision); build it for images only."""

    def __init__(self, image_processor=None, tokenizer=None, **kw):
        self.image_token, self.video_token = "<|image|>", "<|video|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer)
        self.video_start_id = tokenizer.convert_tokens_to_ids("<|begin_of_video|>")
        self.video_end_id = tokenizer.convert_tokens_to_ids("<|end_of_video|>")


def test_glm4v_expansion_inputs_and_rope_equal_the_model():
    tok = vsm.build_glm4v_tokenizer()
    model = vsm.build_tiny_glm4v(tok)
    config = model.config
    ip = vsm.build_glm4v_image_processor()
    assert family_of(config) is GLM4V
    prepared = GLM4V.prepare_images(ip, _images(), config)
    # GLM-4V's chat template writes the framed single <|image|>; the processor repeats it
    image_slot = "<|begin_of_image|><|image|><|end_of_image|>"
    ref = ImageOnlyGlm4vProcessor(ip, tok)(
        text=[PROMPT.replace(PLACEHOLDER, image_slot)], images=_images(), return_tensors="pt"
    )
    ids = _ids(tok, _expand(PROMPT, prepared))
    assert torch.equal(ids, ref["input_ids"])
    tokens = GLM4V.token_inputs(ids, config)
    assert torch.equal(tokens["mm_token_type_ids"], ref["mm_token_type_ids"])
    ours = GLM4V.model_inputs([p.tensors for p in prepared])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])

    positions = GLM4V.rope_positions(ids[0].tolist(), [p.tensors for p in prepared], config)
    want, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=tokens["mm_token_type_ids"], image_grid_thw=ours["image_grid_thw"]
    )
    assert torch.equal(positions, want[:, 0])

    model.train()
    loss = _train_step(model, ids, {**ours, **tokens})
    assert torch.isfinite(loss)
    _assert_paths_cover_vision(model, GLM4V, config)
    # explicit positions (row 0 text, rows 1-3 M-RoPE: keel's packed form) give the same loss
    text_positions = torch.arange(ids.shape[1])[None, None]
    explicit = torch.cat([text_positions, positions[:, None]])
    assert _train_step(model, ids, {**ours, **tokens, "position_ids": explicit}) == loss


def test_glm4v_pixel_bounds_are_image_pixels():
    """keel's image_min/max_pixels bound the resized image (GLM's size counts it twice)."""
    from transformers import Glm4vImageProcessorPil

    bounds = GLM4V.image_processor_kwargs(min_pixels=56 * 56, max_pixels=112 * 112)
    ip = Glm4vImageProcessorPil(**bounds)
    large, small = vs.make_image(0, (400, 300)), vs.make_image(1, (20, 20))
    for image, low, high in ((large, 84 * 84, 112 * 112), (small, 56 * 56, 84 * 84)):
        (t, h, w), *_ = ip(images=[image], return_tensors="pt")["image_grid_thw"].tolist()
        assert low <= h * w * 14 * 14 <= high


def glm4v_moe_config():
    """The tiny GLM-4V with a mixture of experts (4, 2 per token) after a dense first layer."""
    from transformers import Glm4vMoeConfig

    base = vsm.glm4v_config(vsm.build_glm4v_tokenizer()).to_dict()
    text = dict(
        base["text_config"], n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    text.update(first_k_dense_replace=1, n_shared_experts=1)
    for key in ("model_type", "architectures"):
        text.pop(key, None)
        base["vision_config"].pop(key, None)
    return Glm4vMoeConfig(
        text_config=text,
        vision_config=base["vision_config"],
        **{k: base[k] for k in ("image_token_id", "video_token_id", "image_start_token_id")},
    )


def test_glm4v_moe_loads_its_experts_stacked_as_transformers_does(tmp_path):
    """Its checkpoint holds one tensor per expert; keel's loader stacks them into the fused
    tensors: the same logits as from_pretrained."""
    from transformers import AutoModelForImageTextToText

    from keel.models.materialize import (
        Starts,
        allocate,
        build_empty_model,
        fill_weights,
        init_computed_buffers,
    )

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(glm4v_moe_config()).save_pretrained(tmp_path)
    model = build_empty_model(tmp_path, dtype=torch.float32)
    allocate(model, torch.device("cpu"))
    init_computed_buffers(model)
    fill_weights(model, tmp_path, Starts(seed=0), region_of=lambda p: None, local=lambda p: p)
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        got, want = model.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_glm4v_moe_has_the_same_tree():
    from transformers import AutoModelForImageTextToText

    config = glm4v_moe_config()
    assert family_of(config) is GLM4V
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    for path in (*GLM4V.tower, *GLM4V.projector, GLM4V.language_model):
        model.get_submodule(path)


# ---- loading and refusal --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("writer", "family"),
    [
        (vsm.write_tiny_idefics3_dir, IDEFICS3),
        (vsm.write_tiny_gemma3_dir, GEMMA3),
        (vsm.write_tiny_glm4v_dir, GLM4V),
    ],
)
def test_saved_folder_gives_the_family_and_its_pil_processor(tmp_path, writer, family):
    folder = writer(tmp_path / "model")
    logs = []
    processing = vision_processing(folder, None, log=logs.append)
    assert processing.family is family
    assert type(processing.image_processor).__name__.endswith("Pil")
    prepared = processing.prepare_images(_images())
    assert len(prepared) == 2 and all(p.num_tokens > 0 for p in prepared)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "cogvlm"},
        {"model_type": "cogvlm2", "architectures": ["CogVLMForCausalLM"]},
        {"model_type": "", "architectures": ["CogVLMForCausalLM"]},
    ],
)
def test_cogvlm_is_refused_naming_glm4v(config):
    with pytest.raises(ModelError, match="GLM-4V") as info:
        family_of(config)
    assert "trust_remote_code" in str(info.value)
