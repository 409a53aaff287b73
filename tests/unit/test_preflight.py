"""keel.train.preflight: model, method, precision and strategy problems, found together and
before any data row is read."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

import keel.train.preflight as preflight_module
from keel.config import load_config
from keel.errors import ConfigError
from keel.models import count_parameters
from keel.train.preflight import Preflight, preflight

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # never touched: only the device type is read


def quiet(_msg):
    pass


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"instruction": "Who are you?", "output": "I am Keel."}] * 4))
    return path


@pytest.fixture
def no_data_read(monkeypatch):
    """Fail the test if a data row is read: preparing or loading a dataset."""
    import datasets

    def refuse(*_args, **_kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(preflight_module, "prepare_data", refuse)
    monkeypatch.setattr(datasets, "load_dataset", refuse)


def config(model_dir, data_file, tmp_path, *overrides):
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(tmp_path / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8}},
        "data": {"datasets": [str(data_file)], "cutoff_len": 64},
        "train": {"precision": "fp32"},
        "output": {"dir": str(tmp_path / "out")},
    }
    return load_config(None, list(overrides), base=base)


def problems_of(cfg, tmp_path, device=CPU) -> list[str]:
    with pytest.raises(ConfigError) as info:
        preflight(cfg, base_dir=tmp_path, log=quiet, device=device, source="run.yaml")
    assert str(info.value).startswith(f"{len(info.value.problems)} problem(s) in run.yaml:")
    return info.value.problems


def save_model_dir(model, path, tokenizer=None):
    model.save_pretrained(path)
    (tokenizer or build_tiny_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """GPT-2 keeps its blocks in transformer.h: keel finds no decoder layers in it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=320,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_model_dir(GPT2LMHeadModel(config), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def jetmoe_dir(tmp_path_factory):
    """JetMoE is a causal LM transformers cannot gradient-checkpoint."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    config = JetMoeConfig(
        vocab_size=320,
        hidden_size=32,
        num_hidden_layers=2,
        kv_channels=8,
        intermediate_size=64,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = JetMoeForCausalLM(config)
    assert not model.supports_gradient_checkpointing
    return save_model_dir(model, tmp_path_factory.mktemp("jetmoe"))


def test_lora_target_matching_no_module(tiny_model_dir, data_file, tmp_path, no_data_read):
    cfg = config(tiny_model_dir, data_file, tmp_path, "method.lora.targets=[q_prj, v_proj]")
    [problem] = problems_of(cfg, tmp_path)
    assert problem.startswith(
        "method.lora.targets = ['q_prj', 'v_proj']: no linear module "
        "named 'q_prj' (did you mean q_proj"
    )
    assert (
        "this model has: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, "
        "q_proj, up_proj, v_proj (or use all-linear)"
    ) in problem


def test_freeze_range_past_the_last_layer(tiny_model_dir, data_file, tmp_path, no_data_read):
    cfg = config(
        tiny_model_dir,
        data_file,
        tmp_path,
        "method.type=freeze",
        "method.freeze.trainable_layers=3",
    )
    assert problems_of(cfg, tmp_path) == [
        "method.freeze.trainable_layers = 3 is outside -2..2 (the model has 2 decoder layers); "
        "set it to at most 2 (-N: the first N), or use method.type full to train every layer"
    ]


def test_freeze_module_naming_no_module(tiny_model_dir, data_file, tmp_path, no_data_read):
    cfg = config(
        tiny_model_dir,
        data_file,
        tmp_path,
        "method.type=freeze",
        "method.freeze.trainable_modules=[lm_haed]",
    )
    [problem] = problems_of(cfg, tmp_path)
    assert (
        "method.freeze.trainable_modules: no module named 'lm_haed' (did you mean lm_head"
        in problem
    )
    assert "this model has: " in problem and "embed_tokens" in problem


def test_freeze_with_nothing_to_train(tiny_model_dir, data_file, tmp_path, no_data_read):
    cfg = config(
        tiny_model_dir,
        data_file,
        tmp_path,
        "method.type=freeze",
        "method.freeze.trainable_layers=0",
        "method.freeze.trainable_modules=[act_fn]",
    )
    [problem] = problems_of(cfg, tmp_path)
    assert problem.startswith("method.freeze: nothing would train")


def test_fp16_on_a_cpu(tiny_model_dir, data_file, tmp_path, no_data_read):
    cfg = config(tiny_model_dir, data_file, tmp_path, "train.precision=fp16")
    assert problems_of(cfg, tmp_path) == [
        "train.precision = fp16 is not supported on a CPU; use bf16, fp32 or auto"
    ]


def test_bf16_on_a_gpu_without_it(tiny_model_dir, data_file, tmp_path, no_data_read, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    cfg = config(tiny_model_dir, data_file, tmp_path, "train.precision=bf16")
    assert problems_of(cfg, tmp_path, device=CUDA) == [
        "train.precision = bf16: this GPU (Tesla V100) has no bf16 support; use fp16 or auto"
    ]


@pytest.mark.parametrize("method", ["full", "freeze"])
def test_fp16_weights_with_fp16_loss_scaling(
    tiny_model_dir, data_file, tmp_path, no_data_read, method
):
    cfg = config(
        tiny_model_dir,
        data_file,
        tmp_path,
        f"method.type={method}",
        "model.dtype=float16",
        "train.precision=fp16",
    )
    [problem] = problems_of(cfg, tmp_path, device=CUDA)
    assert problem.startswith("model.dtype = float16 with train.precision = fp16")
    assert "model.dtype=auto" in problem


def test_fp16_weights_are_fine_under_lora(tiny_model_dir, data_file, tmp_path, monkeypatch):
    # PEFT keeps the adapters in float32, so only frozen weights are float16: the scaler
    # never sees an fp16 gradient. Stop right after the model checks.
    monkeypatch.setattr(preflight_module, "prepare_data", lambda *a, **k: "data")
    cfg = config(tiny_model_dir, data_file, tmp_path, "model.dtype=float16", "train.precision=fp16")
    checked = preflight(cfg, base_dir=tmp_path, log=quiet, device=CUDA)
    assert checked.data == "data" and checked.precision.name == "fp16"


def test_fsdp_without_findable_decoder_layers(gpt2_dir, data_file, tmp_path, no_data_read):
    cfg = config(gpt2_dir, data_file, tmp_path, "method.type=full", "distributed.strategy=fsdp")
    assert problems_of(cfg, tmp_path) == [
        "distributed.strategy = fsdp shards the model one decoder layer at a time, but keel "
        "cannot find the decoder layers of GPT2LMHeadModel (looked at "
        "model.get_decoder().layers and model.model.layers); use distributed.strategy ddp"
    ]


def test_freeze_without_findable_decoder_layers(gpt2_dir, data_file, tmp_path, no_data_read):
    cfg = config(gpt2_dir, data_file, tmp_path, "method.type=freeze")
    [problem] = problems_of(cfg, tmp_path)
    assert problem.startswith(
        "method.type = freeze trains the last decoder layers, but keel "
        "cannot find those of GPT2LMHeadModel"
    )


def test_flash_attention_without_a_gpu(tiny_model_dir, data_file, tmp_path, no_data_read):
    cfg = config(tiny_model_dir, data_file, tmp_path, "model.attn_implementation=flash_attention_2")
    assert problems_of(cfg, tmp_path) == [
        "model.attn_implementation = flash_attention_2 needs a CUDA GPU and this machine has "
        "none; use auto (the default)"
    ]


def test_flash_attention_not_installed(
    tiny_model_dir, data_file, tmp_path, no_data_read, monkeypatch
):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda *a: False)
    cfg = config(tiny_model_dir, data_file, tmp_path, "model.attn_implementation=flash_attention_2")
    [problem] = problems_of(cfg, tmp_path, device=CUDA)
    assert "needs the flash-attn package" in problem and "pip install flash-attn" in problem


def test_gradient_checkpointing_unsupported(jetmoe_dir, data_file, tmp_path, no_data_read):
    cfg = config(jetmoe_dir, data_file, tmp_path, "train.gradient_checkpointing=true")
    assert problems_of(cfg, tmp_path) == [
        "train.gradient_checkpointing = true, but JetMoeForCausalLM does not support gradient "
        "checkpointing in transformers; set train.gradient_checkpointing=false (or use a "
        "smaller micro_batch_size)"
    ]


def test_tokenizer_ids_past_the_embeddings(tmp_path, data_file, no_data_read):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer))
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})  # id 320, one past the matrix
    model_dir = save_model_dir(model, tmp_path / "model", tokenizer)
    [problem] = problems_of(config(model_dir, data_file, tmp_path), tmp_path)
    assert "the tokenizer's special token ids [320] are >= the 320 rows" in problem


def test_every_problem_in_one_message(tiny_model_dir, tmp_path, no_data_read):
    """Model, method, precision, attention and data paths: one error, nothing read."""
    cfg = config(
        tiny_model_dir,
        tmp_path / "missing.json",
        tmp_path,
        "method.type=freeze",
        "method.freeze.trainable_layers=5",
        "method.freeze.trainable_modules=[nrom]",
        "train.precision=fp16",
        "model.attn_implementation=flash_attention_2",
    )
    problems = problems_of(cfg, tmp_path)
    assert [p.split(" ", 1)[0] for p in problems] == [
        "train.precision",
        "model.attn_implementation",
        "method.freeze.trainable_layers",
        "method.freeze.trainable_modules:",
        "data.datasets[0]",
    ]
    assert "file not found" in problems[-1]


def test_unknown_bundled_model_is_reported_with_the_rest(data_file, tmp_path, no_data_read):
    cfg = config("bundled:smollm3", data_file, tmp_path, "train.precision=fp16")
    problems = problems_of(cfg, tmp_path)
    assert problems[0].startswith("train.precision = fp16")
    assert problems[1].startswith("unknown bundled model 'smollm3'")


def test_valid_config_returns_what_training_needs(tiny_model_dir, data_file, tmp_path):
    cfg = config(
        tiny_model_dir,
        data_file,
        tmp_path,
        "distributed.strategy=fsdp",
        "distributed.fsdp.cpu_offload=true",
        "train.gradient_checkpointing=true",
    )
    logs = []
    checked = preflight(cfg, base_dir=tmp_path, log=logs.append, device=CPU)
    assert isinstance(checked, Preflight)
    model_dir, tokenizer, data = checked.model_dir, checked.tokenizer, checked.data
    assert model_dir == tiny_model_dir and tokenizer.pad_token_id is not None
    assert len(data.train) == 4
    real = build_tiny_model(len(tokenizer))
    assert checked.model.params == count_parameters(real)[1]
    # LoRA r=4 on every linear of both layers: r * (in + out) each
    lora = sum(
        4 * (m.in_features + m.out_features)
        for n, m in real.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    )
    assert (checked.model.trainable, checked.model.total) == (lora, checked.model.params + lora)
    assert checked.notes == [
        "distributed.fsdp.cpu_offload = true is ignored on this machine: "
        "there is no CUDA GPU, so parameters already live in CPU memory"
    ]
    assert any(
        line.startswith("model: LlamaForCausalLM (llama, 2 decoder layers)") for line in logs
    )
    summary = checked.summary()
    assert [line.split(":", 1)[0] for line in summary] == [
        "model",
        "method",
        "precision",
        "data",
        "steps",
        "note",
    ]
    assert summary[3].endswith("4 rows read, 4 kept -> 4 train rows, 0 eval rows")
