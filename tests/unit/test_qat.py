"""Quantization-aware training (method.qat): the decoder's linear layers train rounded as
the scheme rounds, and `keel export --quantize` writes the model that computes exactly what
the QAT model computed.

Resume by step (start_step) is in tests/unit/test_train_run.py, the plan's saved tensors in
tests/unit/test_plan_activations.py, FSDP2 == one process in tests/distributed."""

from __future__ import annotations

import json

import pytest
import torch
from config_support import tiny_lora_config
from conftest import build_tiny_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from keel.config import load_config
from keel.config.schema import QatConfig
from keel.errors import ConfigError, ModelError
from keel.export import ExportRequest, export_model
from keel.models.qat import fake_quantize, qat_problems
from keel.plan.architecture import build_meta_model
from keel.quant.qat import set_fake_quantization
from keel.train.run import run_training

pytest.importorskip("torchao.quantization.qat")
IDS = torch.tensor([[1, 5, 9, 14, 3, 22, 7, 8, 30, 41, 2]])


def quiet(_message):
    pass


def run_config(model_dir, data_file, out, **qat) -> dict:
    """A 2-step full run of the tiny model (fp32), with method.qat as given."""
    output = {"save_every": 1, "keep_last": 2, "log_every": 1}
    return tiny_lora_config(model_dir, data_file, out, output=output) | {
        "method": {"type": "full", "qat": qat}
    }


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """A QAT run (int8-int4, rounded from step 2), the same run without QAT, and one rounded
    from the first step: name -> (output dir, per-step losses)."""
    root = tmp_path_factory.mktemp("qat")
    data = root / "qa.json"
    rows = [
        {"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(8)
    ]
    data.write_text(json.dumps(rows))
    found = {}
    for name, qat in {
        "qat": {"scheme": "int8-int4", "start_step": 1},
        "plain": {},
        "from-the-start": {"scheme": "int8-int4"},
    }.items():
        out = root / name
        result = run_training(
            load_config(None, [], base=run_config(tiny_model_dir, data, out, **qat)), log=quiet
        )
        found[name] = (out, result.losses)
    return found


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def export(model, out, quantize="trained"):
    return export_model(ExportRequest(model=str(model), out=out, quantize=quantize), log=quiet)


def test_the_swap_keeps_every_parameter_its_tie_and_its_name():
    model = build_tiny_model(64)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert fake_quantize(model, QatConfig(scheme="int8-int4")) == 14  # 2 layers x 7 linears
    assert sum(type(m).__name__ == "FakeQuantizedLinear" for m in model.modules()) == 14
    assert dict(model.named_parameters()) == before  # the same tensors, by identity
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head) is torch.nn.Linear  # the output layer is not rounded
    # on the meta device too (where torchao's own swap makes new parameters)
    meta = build_meta_model(model.config, dtype=torch.float32)
    meta_before = dict(meta.named_parameters())
    fake_quantize(meta, QatConfig(scheme="fp8"))
    assert dict(meta.named_parameters()) == meta_before


def test_the_rounding_changes_the_model_and_turns_off():
    model = build_tiny_model(64)
    plain = logits(model)
    fake_quantize(model, QatConfig(scheme="int8-int4"))
    rounded = logits(model)
    assert (rounded - plain).abs().max() > 1e-3
    set_fake_quantization(model, False)
    torch.testing.assert_close(logits(model), plain, rtol=0, atol=0)


def test_training_rounds_from_start_step_on(runs):
    _out, qat = runs["qat"]
    _out, plain = runs["plain"]
    _out, from_start = runs["from-the-start"]
    assert qat[0] == pytest.approx(plain[0], abs=0)  # step 1: not rounded yet
    assert abs(qat[1] - plain[1]) > 1e-4  # step 2 rounded
    assert abs(from_start[0] - plain[0]) > 1e-4  # rounded from step 1


def test_the_quantized_export_computes_what_the_qat_model_computed(runs, tmp_path):
    out, _losses = runs["from-the-start"]
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    unrounded = logits(trained)
    fake_quantize(trained, QatConfig(scheme="int8-int4"))  # the model as it trained
    as_trained = logits(trained)

    quantized_dir = export(out, tmp_path / "quantized")
    quantized = AutoModelForCausalLM.from_pretrained(quantized_dir, dtype=torch.float32)
    kinds = {
        type(p).__name__ for n, p in quantized.named_parameters() if ".layers." in n and "proj" in n
    }
    assert kinds == {"IntxUnpackedToInt8Tensor"}
    torch.testing.assert_close(logits(quantized), as_trained, rtol=0, atol=1e-5)
    assert (logits(quantized) - unrounded).abs().max() > 1e-3  # the rounding is in it
    provenance = json.loads((quantized_dir / "keel_export.json").read_text())
    assert provenance["quantized"] == {
        "scheme": "int8-int4",
        "group_size": 32,
        "start_step": 0,
        "layers": 14,
    }
    assert json.loads((quantized_dir / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ] == ["lm_head"]

    # the last checkpoint exports the same tensors (its meta.json names the scheme)
    from_checkpoint = export(out / "checkpoints" / "step-00000002", tmp_path / "from-checkpoint")
    with (
        safe_open(quantized_dir / "model.safetensors", "pt") as a,
        safe_open(from_checkpoint / "model.safetensors", "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():  # noqa: SIM118
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_export_quantize_names_the_scheme_it_needs(runs, tmp_path):
    qat_out, _ = runs["qat"]
    plain_out, _ = runs["plain"]
    with pytest.raises(ModelError, match="not trained with method.qat.*int8-int4 \\| int4 \\| fp8"):
        export(plain_out, tmp_path / "a")
    with pytest.raises(ModelError, match="trained for int8-int4"):
        export(qat_out, tmp_path / "b", quantize="fp8")
    with pytest.raises(ModelError, match="not a scheme"):
        export(qat_out, tmp_path / "c", quantize="nf4")
    assert not any(tmp_path.iterdir())  # nothing written for a refusal
    # post-training quantization of a run without QAT: asked by name
    ptq = export(plain_out, tmp_path / "ptq", quantize="int8-int4")
    assert json.loads((ptq / "keel_export.json").read_text())["quantized"]["scheme"] == "int8-int4"


@pytest.mark.skipif(torch.cuda.is_available(), reason="int4's kernels are CUDA's")
def test_int4_without_cuda_says_how_to_quantize_on_the_gpu(runs, tmp_path):
    plain_out, _ = runs["plain"]
    with pytest.raises(ModelError, match=r"Int4WeightOnlyConfig\(group_size=32\)"):
        export(plain_out, tmp_path / "int4", quantize="int4")
    assert not (tmp_path / "int4").exists()


def test_qat_refuses_what_it_cannot_train(tiny_model_dir):
    base = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"datasets": ["x.json"]},
        "output": {"dir": "o"},
    }
    with pytest.raises(ConfigError, match="method.qat.scheme = int4 with method.type = lora"):
        load_config(None, ["method.type=lora", "method.qat.scheme=int4"], base=base)
    model = build_meta_model(build_tiny_model(64).config, dtype=torch.float32)  # widths 32, 64
    assert qat_problems(model, QatConfig(scheme="int8-int4", group_size=16)) == []
    (misfit,) = qat_problems(model, QatConfig(scheme="int8-int4", group_size=48))
    assert "does not divide" in misfit and "32, 64" in misfit
    (int4,) = qat_problems(model, QatConfig(scheme="int4", group_size=16))
    assert "32, 64, 128, 256" in int4
    assert qat_problems(model, QatConfig(scheme="fp8", group_size=48)) == []  # not grouped


def test_qat_refuses_a_vision_language_model():
    from vlm_support import build_qwen2_vl_tokenizer, qwen2_vl_config

    config = qwen2_vl_config(build_qwen2_vl_tokenizer())
    (problem,) = qat_problems(
        build_meta_model(config, dtype=torch.float32), QatConfig(scheme="fp8")
    )
    assert "vision-language" in problem
