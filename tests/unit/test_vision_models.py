"""Vision-language models in keel.models: loading (legacy checkpoint names), what trains
(model.vision switches, LoRA on the language model only, unused tower layers), QLoRA on the
language model, and save -> reload."""

from __future__ import annotations

import pytest
import torch
from vlm_support import write_tiny_llava_dir, write_tiny_qwen2_vl_dir

from keel.config.schema import FreezeConfig, LoraConfig, MethodConfig, VisionConfig
from keel.errors import ModelError
from keel.models.adapters import apply_method, load_for_inference, save_model_dir
from keel.models.loading import load_model, load_tokenizer
from keel.models.materialize import (
    Starts,
    allocate,
    build_empty_model,
    checkpoint_key,
    fill_weights,
    init_computed_buffers,
)
from keel.models.trainable import decoder_layers
from keel.models.vision_parts import part_counts, vision_family

WRITERS = {"qwen2_vl": write_tiny_qwen2_vl_dir, "llava": write_tiny_llava_dir}
LM_LINEARS = 14  # q, k, v, o, gate, up, down in each of the 2 tiny decoder layers


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {name: write(root / name) for name, write in WRITERS.items()}


def hf_load(folder):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)


def keel_build(folder, method: MethodConfig | None = None, vision: VisionConfig | None = None):
    """As training builds it: meta device, method, allocate, fill tensor by tensor."""
    model = build_empty_model(folder, dtype=torch.float32)
    if method is not None:
        with torch.device("meta"):
            model = apply_method(model, method, log=lambda _: None, vision=vision)
    allocate(model, torch.device("cpu"))
    init_computed_buffers(model.get_base_model() if method and method.uses_lora else model)
    fill_weights(model, folder, Starts(seed=0), region_of=lambda _: None, local=lambda p: p)
    return model


def own_state(model) -> dict[str, torch.Tensor]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {k: v for k, v in base.state_dict().items() if "lora_" not in k}


def lora(r=4, targets="all-linear") -> MethodConfig:
    return MethodConfig(type="lora", lora=LoraConfig(r=r, alpha=8.0, dropout=0.0, targets=targets))


def image_batch(name: str, folder):
    """A one-image forward batch for the tiny family (input ids hold the image tokens)."""
    from vlm_support import build_llava_image_processor, build_qwen2_vl_image_processor, make_image

    image = make_image(0)
    tok = load_tokenizer(folder)
    if name == "llava":
        pixels = build_llava_image_processor()(images=[image], return_tensors="pt")
        ids = [5, 6] + [tok.convert_tokens_to_ids("<image>")] * 16 + [7, 8, 9]
        return dict(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"])
    out = build_qwen2_vl_image_processor()(images=[image], return_tensors="pt")
    count = int(out["image_grid_thw"][0].prod()) // 4
    pad, start, end = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    ids = torch.tensor([[5, 6, start] + [pad] * count + [end, 7, 8, 9]])
    return dict(
        input_ids=ids,
        pixel_values=out["pixel_values"],
        image_grid_thw=out["image_grid_thw"],
        mm_token_type_ids=(ids == pad).long(),
    )


@pytest.mark.parametrize("name", list(WRITERS))
def test_keel_loads_every_tensor_as_transformers(name, folders):
    folder = folders[name]
    want = hf_load(folder).state_dict()
    got = keel_build(folder).state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    assert type(load_model(folder, dtype=torch.float32)).__name__.endswith(
        "ForConditionalGeneration"
    )


def test_legacy_and_new_checkpoint_names_both_load(folders, tmp_path):
    """The tiny folders hold transformers' legacy names (visual.*, model.layers.*); a folder
    written in the 5.x module names loads as well."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = folders["qwen2_vl"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert any(k.startswith("visual.") for k in f.keys())
    want = hf_load(folder).state_dict()
    new = tmp_path / "new-names"
    new.mkdir()
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (new / path.name).write_bytes(path.read_bytes())
    save_file({k: v.contiguous() for k, v in want.items()}, str(new / "model.safetensors"))
    got = keel_build(new).state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("name", list(WRITERS))
def test_lora_wraps_language_model_modules_only(name, folders):
    model = keel_build(folders[name], lora())
    wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == LM_LINEARS, wrapped
    assert all(".language_model." in n for n in wrapped)
    # keel's short-name lists: CLIP's q_proj/v_proj are not adapted either
    model = keel_build(folders[name], lora(targets=["q_proj", "v_proj"]))
    assert len([n for n, m in model.named_modules() if hasattr(m, "lora_A")]) == 4


def test_lora_targets_inside_the_tower_only_are_refused(folders):
    model = build_empty_model(folders["qwen2_vl"], dtype=torch.float32)
    with pytest.raises(ModelError, match="outside the vision tower and projector"):
        apply_method(model, lora(targets=["qkv"]), log=lambda _: None)


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("method", ["full", "freeze", "lora"])
def test_frozen_tower_gets_no_gradient_and_projector_trains(name, method, folders):
    methods = {
        "full": MethodConfig(type="full"),
        "freeze": MethodConfig(type="freeze", freeze=FreezeConfig(trainable_layers=1)),
        "lora": lora(),
    }
    vision = VisionConfig(freeze_tower=True, freeze_projector=False)
    model = keel_build(folders[name], methods[method], vision)
    family = vision_family(model)
    model(**image_batch(name, folders[name]), use_cache=False).logits.float().pow(
        2
    ).mean().backward()
    tower = [p for n, p in model.named_parameters() if _part(family, n) == "tower"]
    projector = [
        p
        for n, p in model.named_parameters()
        if _part(family, n) == "projector" and p.requires_grad
    ]
    assert tower and all(p.grad is None and not p.requires_grad for p in tower)
    assert projector and all(p.grad is not None and p.grad.abs().sum() > 0 for p in projector)
    counts = part_counts(model, family)
    assert counts["tower"][0] == 0 and counts["projector"][0] == counts["projector"][1] > 0
    assert counts["language model"][0] > 0


def _part(family, name):
    from keel.models.vision_parts import part_of

    return part_of(family, name)


def test_trainable_tower_trains_except_unused_llava_layers(folders):
    vision = VisionConfig(freeze_tower=False, freeze_projector=False)
    for method in (MethodConfig(type="full"), lora()):
        model = keel_build(folders["llava"], method, vision)
        names = {checkpoint_key(n) for n, p in model.named_parameters() if p.requires_grad}
        # vision_feature_layer -2: the last CLIP layer and post_layernorm are never read
        assert not any(
            "vision_tower.encoder.layers.1." in n or "post_layernorm" in n for n in names
        )
        assert any("vision_tower.encoder.layers.0." in n for n in names), method.type


def test_freeze_counts_language_model_decoder_layers(folders):
    model = build_empty_model(folders["llava"], dtype=torch.float32)
    assert decoder_layers(model) is model.model.language_model.layers
    with pytest.raises(ModelError, match="the model has 2 decoder layers"):
        apply_method(model, MethodConfig(type="freeze", freeze=FreezeConfig(trainable_layers=3)))


def test_qlora_quantises_language_model_linears_only(folders):
    from keel.quant.nf4 import is_nf4, quantize_on_meta

    model = build_empty_model(folders["qwen2_vl"], dtype=torch.float32)
    with torch.device("meta"):
        model = apply_method(model, lora(), log=lambda _: None)
    quantized, _ = quantize_on_meta(decoder_layers(model.get_base_model()), torch.float32, 1)
    assert quantized
    assert all(".language_model." in n for n, p in model.named_parameters() if is_nf4(p))
    assert not any(is_nf4(p) for n, p in model.named_parameters() if "visual" in n)


@pytest.mark.parametrize("name", list(WRITERS))
def test_save_and_reload_identical(name, folders, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    folder = folders[name]
    tokenizer = load_tokenizer(folder)
    model = keel_build(folder, MethodConfig(type="full"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_model_dir(model, tokenizer, tmp_path / "full")
    assert (tmp_path / "full" / "preprocessor_config.json").is_file()
    AutoImageProcessor.from_pretrained(str(tmp_path / "full"))
    reloaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "full"))
    want = model.state_dict()
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(
        keel_build(tmp_path / "full").state_dict()["lm_head.weight"], want["lm_head.weight"]
    )


def test_lora_with_trainable_projector_saves_and_loads_on_the_base(folders, tmp_path):
    folder = folders["llava"]
    vision = VisionConfig(freeze_projector=False)
    model = keel_build(folder, lora(), vision)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    batch = image_batch("llava", folder)
    with torch.no_grad():
        want = model(**batch, use_cache=False).logits
    save_model_dir(model, load_tokenizer(folder), tmp_path / "adapter")
    assert (tmp_path / "adapter" / "preprocessor_config.json").is_file()
    net, _ = load_for_inference(
        str(tmp_path / "adapter"), None, cache_dir=tmp_path, log=lambda _: None
    )
    with torch.no_grad():
        got = net(**batch, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # a keel rebuild of base + method starts from the base: the projector copy is the base's
    rebuilt = keel_build(folder, lora(), vision)
    base = dict(hf_load(folder).named_parameters())
    copy = dict(rebuilt.named_parameters())
    key = "base_model.model.model.multi_modal_projector.modules_to_save.default.linear_1.weight"
    assert torch.equal(copy[key], base["model.multi_modal_projector.linear_1.weight"])


@pytest.mark.parametrize("name", list(WRITERS))
def test_computed_buffers_equal_transformers(name, folders):
    """Non-persistent buffers (rotary tables, CLIP's position ids) are not in the checkpoint;
    keel computes them with the tower's own initialiser."""
    want = dict(hf_load(folders[name]).named_buffers())
    got = dict(keel_build(folders[name]).named_buffers())
    assert got.keys() == want.keys()
    for key, buffer in want.items():
        assert torch.equal(got[key], buffer), key


def test_freeze_trainable_modules_win_over_the_vision_switches(folders):
    method = MethodConfig(
        type="freeze",
        freeze=FreezeConfig(trainable_layers=1, trainable_modules=["multi_modal_projector"]),
    )
    model = build_empty_model(folders["llava"], dtype=torch.float32)
    model = apply_method(model, method, log=lambda _: None)  # freeze_projector: true (default)
    counts = part_counts(model, vision_family(model))
    assert counts["projector"][0] == counts["projector"][1] > 0 and counts["tower"][0] == 0


def test_lora_with_trainable_qwen2_vl_tower_trains_its_blocks(folders):
    """A trainable tower under LoRA: PEFT copies of the tower's blocks (modules_to_save),
    called one by one as the tower iterates over its blocks."""
    vision = VisionConfig(freeze_tower=False)
    model = keel_build(folders["qwen2_vl"], lora(), vision)
    batch = image_batch("qwen2_vl", folders["qwen2_vl"])
    model(**batch, use_cache=False).logits.pow(2).mean().backward()
    family = vision_family(model)
    tower = {n: p for n, p in model.named_parameters() if _part(family, n) == "tower"}
    trained = [n for n, p in tower.items() if p.requires_grad]
    assert trained and all("modules_to_save.default" in n for n in trained)
    assert all(tower[n].grad is not None for n in trained)
    assert not any(".lora_A." in n for n in tower)


def test_model_vision_section_reads_and_bounds_are_checked(tmp_path):
    from config_support import minimal_config

    from keel.config import load_config
    from keel.errors import ConfigError

    base = minimal_config(tmp_path)
    cfg = load_config(None, ["model.vision.freeze_projector=false"], base=base)
    assert cfg.model.vision == VisionConfig(freeze_projector=False)
    bad = ["model.vision.image_min_pixels=0", "model.vision.image_max_pixels=100000000"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, bad, base=base)
    message = str(caught.value)
    assert "model.vision.image_min_pixels = 0 must be > 0" in message
    assert "model.vision.image_max_pixels = 100000000 is above 67108864" in message
    with pytest.raises(ConfigError, match="is below model.vision.image_min_pixels"):
        load_config(None, ["model.vision.image_max_pixels=10"], base=base)
