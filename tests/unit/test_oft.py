"""method.type oft: PEFT's orthogonal fine-tuning as keel applies, saves, reloads, merges,
continues and validates it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import build_tiny_model

from keel.config import load_config
from keel.config.schema import MethodConfig, OftConfig
from keel.errors import ConfigError, ModelError
from keel.models.adapters import apply_method, count_parameters, save_model_dir
from keel.models.loading import load_model

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])  # [1, T]
LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # [1, T, V]


def oft_method(**settings) -> MethodConfig:
    return MethodConfig(type="oft", oft=OftConfig(**settings))


def turn_rotations(model, seed: int = 0) -> None:
    """OFT starts at the identity rotation (zero skew matrices): give every block a real
    turn so that parity tests compare something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".oft_R." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def test_oft_trains_only_the_rotations_and_starts_at_the_base():
    base = build_tiny_model(320).eval()
    want = logits(base)
    logs = []
    model = apply_method(build_tiny_model(320), oft_method(block_size=16), log=logs.append)
    wrapped = [m for m in model.modules() if hasattr(m, "oft_R")]
    assert {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m in wrapped} == LINEARS
    # a layer of d inputs: d / b blocks of b(b - 1) / 2 parameters each
    expected = sum(m.in_features // 16 * (16 * 15 // 2) for m in wrapped)
    assert count_parameters(model)[0] == expected
    assert all(".oft_R." in n for n, p in model.named_parameters() if p.requires_grad)
    assert any(line.startswith("OFT block_size=16 on: down_proj, gate_proj") for line in logs)
    model.eval()
    torch.testing.assert_close(logits(model), want, atol=1e-6, rtol=0)  # the identity
    turn_rotations(model)
    assert (logits(model) - want).abs().max() > 1e-3  # negative control: a turn shows


def test_a_block_size_that_does_not_divide_a_layer_is_named():
    """PEFT gives such a layer the nearest size that divides its inputs, warning per layer;
    keel says it once, naming the layers and the sizes they got."""
    logs = []
    model = apply_method(build_tiny_model(320), oft_method(block_size=24), log=logs.append)
    note = next(line for line in logs if line.startswith("note: method.oft.block_size 24"))
    assert "down_proj (64: blocks of 16)" in note and "q_proj (32: blocks of 16)" in note
    sizes = {m.oft_block_size["default"] for m in model.modules() if hasattr(m, "oft_R")}
    assert sizes == {16}


def test_oft_problems_name_the_method_oft_keys():
    with pytest.raises(ModelError, match=r"method.oft.targets = \['q_prj'\]: no linear module"):
        apply_method(build_tiny_model(320), oft_method(targets=["q_prj"]))
    # the tiny model ties its output layer to the embeddings, which PEFT's OFT cannot keep tied
    with pytest.raises(ModelError, match="method.oft.modules_to_save .* cannot keep tied"):
        apply_method(build_tiny_model(320), oft_method(modules_to_save=["lm_head"]))


def test_an_untied_output_layer_trains_in_full_beside_the_rotations(tmp_path):
    from peft import PeftModel

    model = build_tiny_model(320)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path / "base")
    live = apply_method(model, oft_method(modules_to_save=["lm_head"]), log=lambda _m: None)
    trained = [n for n, p in live.named_parameters() if p.requires_grad]
    assert any("lm_head.modules_to_save" in n for n in trained)
    assert not any("embed_tokens" in n for n in trained)
    with torch.no_grad():
        live.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    turn_rotations(live)
    live.eval()
    live.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        load_model(tmp_path / "base", dtype=torch.float32), tmp_path / "adapter"
    )
    torch.testing.assert_close(logits(reloaded.eval()), logits(live), atol=1e-6, rtol=0)


def test_saved_adapter_reloads_and_merges_to_the_same_logits(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    live = apply_method(
        load_model(tiny_model_dir, dtype=torch.float32),
        oft_method(block_size=16),
        log=lambda _m: None,
    )
    turn_rotations(live)
    live.eval()
    want = logits(live)
    save_model_dir(live, tiny_tokenizer, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "OFT" and config["oft_block_size"] == 16
    reloaded = PeftModel.from_pretrained(
        load_model(tiny_model_dir, dtype=torch.float32), tmp_path / "adapter"
    )
    torch.testing.assert_close(logits(reloaded.eval()), want, atol=1e-6, rtol=0)
    save_model_dir(live, tiny_tokenizer, tmp_path / "merged", merged=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits(merged.eval()), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(live), want, atol=0, rtol=0)  # the live model unmerged


def _config(tmp_path, model_dir, *overrides: str):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps([{"instruction": "Q?", "input": "", "output": "A."}]))
    base = {
        "model": {"path": str(model_dir)},
        "method": {"type": "oft"},
        "data": {"datasets": [str(data)]},
        "output": {"dir": str(tmp_path / "out")},
    }
    return load_config(None, list(overrides), base=base)


def test_validation_of_the_oft_section(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"method.oft.block_size = 0 must be > 0"):
        _config(tmp_path, tiny_model_dir, "method.oft.block_size=0")
    with pytest.raises(ConfigError, match="method.qat.scheme = int4 with method.type = oft"):
        _config(tmp_path, tiny_model_dir, "method.qat.scheme=int4")
    assert _config(tmp_path, tiny_model_dir, "output.merge_lora=true").output.merge_lora


def _save_oft_adapter(model_dir, out, **settings):
    from peft import OFTConfig, get_peft_model

    config = OFTConfig(target_modules=["q_proj", "v_proj"], **{"r": 0, **settings})
    get_peft_model(load_model(model_dir, dtype=torch.float32), config).save_pretrained(out)
    return out


def test_a_saved_oft_adapter_keeps_training_with_its_shape(tmp_path, tiny_model_dir):
    """model.adapter: the adapter's block size, targets and parameterisation are its
    weights' (and function's); a config that says otherwise is refused, naming both."""
    folder = _save_oft_adapter(tiny_model_dir, tmp_path / "a", oft_block_size=8)
    cfg = _config(tmp_path, tiny_model_dir, f"model.adapter={folder}")
    assert cfg.method.oft.block_size == 8
    assert sorted(cfg.method.oft.targets) == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"method.oft.block_size = 16, but model.adapter"):
        _config(tmp_path, tiny_model_dir, f"model.adapter={folder}", "method.oft.block_size=16")
    with pytest.raises(ConfigError, match=r"is an OFT adapter, but method.type = lora"):
        _config(tmp_path, tiny_model_dir, f"model.adapter={folder}", "method.type=lora")
    ranked = _save_oft_adapter(tiny_model_dir, tmp_path / "b", r=2, oft_block_size=0)
    with pytest.raises(ConfigError, match=r"fixes its blocks per layer \(r 2\)"):
        _config(tmp_path, tiny_model_dir, f"model.adapter={ranked}")


def test_the_plan_counts_what_oft_trains(tiny_model_dir):
    from keel.plan.architecture import build_meta_model
    from keel.plan.census import take_census
    from keel.precision import Precision

    model = build_tiny_model(320)
    live = apply_method(model, oft_method(block_size=16), log=lambda _m: None)
    census = take_census(
        build_meta_model(model.config, dtype=torch.float32),
        oft_method(block_size=16),
        precision=Precision("fp32", "test"),
    )
    trainable = sum(math.prod(t.shape) for t in census.tensors if t.trainable)
    assert trainable == count_parameters(live)[0]
    blocks = {m.oft_block for layer in census.layers for m in layer.linears}
    assert blocks == {16}


def test_oft_turns_a_vision_language_models_language_model_only():
    """As LoRA: the tower and projector are model.vision's (here the projector trains in
    full), and the rotations sit in the language model's linear layers only."""
    from vlm_support import build_tiny_qwen2_vl

    from keel.config.schema import VisionConfig

    logs = []
    model = apply_method(
        build_tiny_qwen2_vl(),
        oft_method(block_size=8),
        log=logs.append,
        vision=VisionConfig(freeze_projector=False),
    )
    rotated = [n for n, m in model.named_modules() if hasattr(m, "oft_R")]
    assert rotated and all(".language_model." in n for n in rotated)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".merger." in n and "modules_to_save" in n for n in trained)
    assert not any(".visual.blocks." in n for n in trained)
