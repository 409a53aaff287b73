"""Axolotl keys whose fate depends on the others beside them: their non-AMP bfloat16 and
float16 against bf16 and fp16, and keys keel does another way."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.config.dialects.axolotl import translate_axolotl

BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}


def _translate(**keys):
    translation = translate_axolotl({**BASE, **keys}, Path("x.yml"))
    return translation, {f.key: f for f in translation.fates}


@pytest.mark.parametrize(
    ("keys", "dtype", "precision"),
    [
        ({"bfloat16": True}, "bfloat16", "bf16"),
        ({"bfloat16": True, "bf16": True, "fp16": None}, "bfloat16", "bf16"),  # phi lora-3.5
        ({"float16": True, "fp16": True}, "float16", "fp16"),
        ({"bfloat16": False, "bf16": "auto"}, None, "auto"),
    ],
)
def test_their_non_amp_half_precision_stores_the_weights_in_it(keys, dtype, precision):
    translation, fates = _translate(**keys)
    assert translation.refused() == []
    assert translation.config.get("model", {}).get("dtype") == dtype
    assert translation.config["train"]["precision"] == precision
    if dtype and "bf16" in keys:
        assert fates["bf16"].fate == "ignored" and "decides the precision" in fates["bf16"].why


def test_contradicting_precisions_are_refused():
    _, fates = _translate(bfloat16=True, fp16=True)
    assert fates["fp16"].fate == "refused" and "different precisions" in fates["fp16"].why
    _, fates = _translate(bfloat16=True, float16=True)
    assert fates["bfloat16"].fate == fates["float16"].fate == "refused"


def test_keys_keel_does_another_way_are_ignored_saying_how():
    translation, fates = _translate(low_cpu_mem_usage=True, resize_token_embeddings_to_32x=True)
    assert translation.refused() == []
    assert "meta device" in fates["low_cpu_mem_usage"].why
    assert "rounded up to 32" in fates["resize_token_embeddings_to_32x"].why


def test_dora_in_either_dialect_is_method_lora_dora(tmp_path):
    from keel.config import load_config
    from keel.config.dialects.llamafactory import translate_llamafactory
    from keel.errors import ConfigError

    axolotl, fates = _translate(adapter="lora", lora_r=8, lora_alpha=16, peft_use_dora=True)
    assert axolotl.config["method"]["lora"]["dora"] is True and axolotl.refused() == []
    their = {"model_name_or_path": "m", "do_train": True, "finetuning_type": "lora"}
    llamafactory = translate_llamafactory({**their, "use_dora": True}, Path("x.yaml"))
    assert llamafactory.config["method"]["lora"]["dora"] is True
    # their 4-bit base with DoRA: keel's default NF4 (torchao) cannot, bitsandbytes can
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    base = {
        "model": {"path": "bundled:smollm2-135m-instruct"},
        "data": {"datasets": [str(data)]},
        "output": {"dir": str(tmp_path / "out")},
        "method": {"type": "qlora", "lora": {"dora": True}},
    }
    with pytest.raises(ConfigError, match="PEFT's DoRA cannot read torchao's NF4"):
        load_config(None, base=base)
    base["method"]["qlora"] = {"quant_backend": "bnb"}
    assert load_config(None, base=base).method.lora.dora


def test_drop_system_message_is_the_datasets_drop_system():
    datasets = [{"path": "d.jsonl", "type": "chat_template", "drop_system_message": True}]
    translation, fates = _translate(datasets=datasets)
    assert translation.config["data"]["datasets"][0]["drop_system"] is True
    assert fates["datasets.0.drop_system_message"].target == "data.datasets.0.drop_system"


@pytest.mark.parametrize(
    ("model_config", "coefficient"),
    [
        ({"output_router_logits": True}, "model"),  # their Mixtral examples
        ({"output_router_logits": True, "router_aux_loss_coef": 0.02}, 0.02),
        ({"output_router_logits": False, "router_aux_loss_coef": 0.02}, None),
    ],
)
def test_model_config_turns_the_routers_balance_loss_on(model_config, coefficient):
    translation, _ = _translate(model_config=model_config)
    assert translation.refused() == []
    assert translation.config.get("train", {}).get("router_aux_loss_coef") == coefficient


def test_other_model_config_overrides_are_refused():
    translation, fates = _translate(model_config={"rope_theta": 1e6})
    assert [f.key for f in translation.refused()] == ["model_config.rope_theta"]
    assert "as its config.json describes it" in fates["model_config.rope_theta"].why


@pytest.mark.parametrize(("value", "coefficient"), [(0.001, 0.001), (None, None), (0, None)])
def test_llamafactory_moe_aux_loss_coef_is_the_balance_loss(value, coefficient):
    from keel.config.dialects.llamafactory import translate_llamafactory

    raw = {
        "model_name_or_path": "m", "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "dataset": "d", "template": "qwen3", "output_dir": "o", "moe_aux_loss_coef": value,
    }  # fmt: skip
    translation = translate_llamafactory(raw, Path("x.yaml"))
    assert translation.config.get("train", {}).get("router_aux_loss_coef") == coefficient
    assert not [f for f in translation.refused() if f.key == "moe_aux_loss_coef"]


@pytest.mark.parametrize(
    ("value", "fate"),
    [("grouped_mm", "ignored"), ("eager", "ignored"), ("scattermoe", "ignored"), ("x", "refused")],
)
def test_experts_implementations_compute_the_same_experts(value, fate):
    _, fates = _translate(experts_implementation=value)
    assert fates["experts_implementation"].fate == fate


def test_early_stopping_patience_maps_to_keels():
    translation, _ = _translate(early_stopping_patience=3, eval_steps=50, val_set_size=0.05)
    assert translation.refused() == []
    assert translation.config["train"]["early_stopping_patience"] == 3


@pytest.mark.parametrize(
    ("keys", "fates"),
    [
        ({"plugins": ["axolotl.integrations.kernels.KernelsPlugin"], "use_kernels": True,
          "use_scattermoe": True}, {"plugins.0": "ignored", "use_kernels": "ignored",
                                    "use_scattermoe": "ignored"}),
        ({"quantize_moe_experts": True}, {"quantize_moe_experts": "refused"}),  # BASE: full
        ({"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16,
          "quantize_moe_experts": True}, {"quantize_moe_experts": "mapped"}),
        ({"lora_target_parameters": ["mlp.experts.gate_up_proj"]},  # BASE: no adapter
         {"lora_target_parameters": "refused"}),
        ({"adapter": "lora", "lora_r": 8, "lora_alpha": 16,
          "lora_target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
         {"lora_target_parameters": "mapped"}),
        ({"lora_target_parameters": None, "quantize_moe_experts": False},
         {"lora_target_parameters": "ignored", "quantize_moe_experts": "ignored"}),
    ],
)  # fmt: skip
def test_mixture_of_experts_kernels_and_expert_options(keys, fates):
    _, found = _translate(**keys)
    assert {key: found[key].fate for key in fates} == fates


def test_llamafactory_use_v1_kernels_is_a_speed_switch():
    from keel.config.dialects.llamafactory import translate_llamafactory

    raw = {
        "model_name_or_path": "m", "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "d", "template": "qwen3", "output_dir": "o", "use_v1_kernels": True,
    }  # fmt: skip
    translation = translate_llamafactory(raw, Path("x.yaml"))
    fate = next(f for f in translation.fates if f.key == "use_v1_kernels")
    assert fate.fate == "ignored" and "same math" in fate.why


def test_added_tokens_and_a_new_end_token_join_the_vocabulary():
    special = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
    translation, fates = _translate(tokens=["<|im_start|>", "<|im_end|>"], special_tokens=special)
    assert translation.refused() == []
    # <|im_end|> is special (their special_tokens marks it so after `tokens` adds it)
    assert translation.config["model"]["add_tokens"] == ["<|im_start|>"]
    assert translation.config["model"]["add_special_tokens"] == ["<|im_end|>"]
    assert fates["special_tokens.eos_token"].target == "model.add_special_tokens"
    assert fates["special_tokens.pad_token"].fate == "ignored"  # keel pads with its own
    _, refused = _translate(tokens={"bos_token": "<s>"})
    assert refused["tokens"].fate == "refused" and "list of tokens" in refused["tokens"].why


@pytest.mark.parametrize(
    "kernel", ["xformers", "flex_attention", "kernels-community/vllm-flash-attn3"]
)
def test_their_other_attention_kernels_are_keels_auto(kernel):
    translation, fates = _translate(
        attn_implementation=kernel, experimental_skip_move_to_device=True
    )
    assert translation.refused() == []
    assert translation.config["model"]["attn_implementation"] == "auto"
    assert "the same attention" in fates["attn_implementation"].why
    assert "meta device" in fates["experimental_skip_move_to_device"].why


@pytest.mark.parametrize(
    ("qat", "scheme"),
    [
        ({"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 64}, "int8-int4"),
        ({"weight_dtype": "int4"}, "int4"),
        ({"weight_dtype": "fp8", "activation_dtype": "float8_e4m3fn"}, "fp8"),
    ],
)
def test_their_qat_is_method_qat(qat, scheme):
    translation, fates = _translate(qat={**qat, "fake_quant_after_n_steps": 10})
    assert translation.refused() == []
    assert translation.config["method"]["qat"]["scheme"] == scheme
    assert translation.config["method"]["qat"]["start_step"] == 10
    assert translation.config["method"]["qat"].get("group_size", 32) == qat.get("group_size", 32)
    assert fates["qat.weight_dtype"].target == "method.qat.scheme"


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        ({"qat": {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4"}}, "Blackwell"),
        ({"qat": {"weight_dtype": "mxfp4"}}, "Blackwell"),
        ({"qat": {"weight_dtype": "int8", "activation_dtype": "int8"}}, "not a scheme keel"),
        ({"qat": {"weight_dtype": "int4"}, "adapter": "lora"}, "not an adapter"),
    ],
)
def test_qat_keel_cannot_train_is_refused(keys, why):
    _, fates = _translate(**keys)
    assert fates["qat"].fate == "refused" and why in fates["qat"].why


def test_their_qat_examples_schedule_keys():
    _, fates = _translate(cosine_constant_lr_ratio=0, cosine_min_lr_ratio=1.0, eta_min=7e-7)
    assert fates["cosine_constant_lr_ratio"].fate == "ignored"
    assert fates["eta_min"].fate == "ignored" and "reads no such key" in fates["eta_min"].why
    _, fates = _translate(cosine_constant_lr_ratio=0.8, cosine_min_lr_ratio=0.1)
    assert fates["cosine_constant_lr_ratio"].fate == "refused"
    _, fates = _translate(qat={"weight_dtype": "int4", "quantize_embedding": True})
    assert fates["qat.quantize_embedding"].fate == "refused"


def test_their_thinking_fields_are_the_ones_keel_reads():
    dataset = {"path": "d.jsonl", "type": "chat_template", "field_thinking": "thinking",
               "template_thinking_key": "reasoning_content"}  # fmt: skip
    translation, fates = _translate(datasets=[dataset])
    assert translation.refused() == []
    assert fates["datasets.0.field_thinking"].fate == "ignored"
    other = {**dataset, "field_thinking": "analysis"}
    _, fates = _translate(datasets=[other])
    assert fates["datasets.0.field_thinking"].fate == "refused"


def test_their_mxfp4_loading_is_keels_dequantized_load():
    translation, fates = _translate(
        model_quantization_config="Mxfp4Config",
        model_quantization_config_kwargs={"dequantize": True},
    )
    assert translation.refused() == []
    assert "dequantizes" in fates["model_quantization_config"].why
    _, fates = _translate(model_quantization_config="FineGrainedFP8Config")
    assert fates["model_quantization_config"].fate == "refused"


def test_their_older_batch_size_and_fan_in_fan_out():
    translation, fates = _translate(batch_size=32, micro_batch_size=4, lora_fan_in_fan_out=False)
    assert translation.refused() == []
    assert translation.config["train"]["grad_accum"] == 8
    assert fates["lora_fan_in_fan_out"].fate == "ignored"
    _, fates = _translate(batch_size=32, micro_batch_size=4, gradient_accumulation_steps=2)
    assert fates["batch_size"].fate == "ignored"


@pytest.mark.parametrize(
    ("keys", "distributed", "fates"),
    [
        # HSDP: each copy sharded over 4 processes (2 copies on 8)
        (
            {"fsdp_config": {"reshard_after_forward": True}, "dp_shard_size": 4,
             "dp_replicate_size": 2},
            {"strategy": "fsdp", "shard_size": 4},
            {"dp_shard_size": "mapped", "dp_replicate_size": "ignored"},
        ),
        # their FSDP over 1 process per copy is replication
        (
            {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True},
             "dp_shard_size": 1},
            {"strategy": "ddp", "shard_size": None},
            {"dp_shard_size": "mapped"},
        ),
        ({"dp_replicate_size": 2}, {"strategy": None, "shard_size": None},
         {"dp_replicate_size": "refused"}),
    ],
)  # fmt: skip
def test_data_parallel_sizes(keys, distributed, fates):
    translation, found = _translate(**keys)
    written = translation.config.get("distributed", {})
    assert written.get("strategy") == distributed["strategy"]
    assert written.get("fsdp", {}).get("shard_size") == distributed["shard_size"]
    assert {k: found[k].fate for k in fates} == fates


@pytest.mark.parametrize(
    ("keys", "size", "fates"),
    [
        ({"context_parallel_size": 2, "heads_k_stride": 1, "ring_attn_func": "varlen_llama3"},
         2, {"context_parallel_size": "mapped", "heads_k_stride": "ignored",
             "ring_attn_func": "ignored"}),
        ({"sequence_parallel_degree": 4}, 4, {"sequence_parallel_degree": "mapped"}),
        ({"context_parallel_size": 1}, None, {"context_parallel_size": "ignored"}),
        ({"context_parallel_size": "two"}, None, {"context_parallel_size": "refused"}),
    ],
)  # fmt: skip
def test_context_parallel_size_splits_rows_over_processes(keys, size, fates):
    translation, found = _translate(**keys)
    assert translation.config.get("distributed", {}).get("context_parallel") == size
    assert {k: found[k].fate for k in fates} == fates
    if size:
        assert "the same attention" in found[next(iter(keys))].why


@pytest.mark.parametrize(
    ("keys", "size", "fate"),
    [
        ({"tensor_parallel_size": 2, "dp_shard_size": 4, "fsdp_version": 2}, 2, "mapped"),
        ({"tensor_parallel_size": 1}, None, "ignored"),  # their default (falcon-e's configs)
        ({"tensor_parallel_size": 0}, None, "refused"),
    ],
)  # fmt: skip
def test_tensor_parallel_size_splits_layers_over_processes(keys, size, fate):
    translation, found = _translate(**keys)
    written = translation.config.get("distributed", {})
    assert written.get("tensor_parallel") == size
    assert found["tensor_parallel_size"].fate == fate
    if size:  # their llama-3_1-8b-hsdp-tp: FSDP2 over 4 processes of each tp rank
        assert written["fsdp"]["shard_size"] == 4


@pytest.mark.parametrize(
    ("keys", "fates"),
    [
        ({"torch_compile": True, "torch_compile_mode": "max-autotune"},
         {"torch_compile": "ignored", "torch_compile_mode": "ignored"}),
        ({"fused_attn_kernel": True, "gemma4_hybrid_attn_impl": True},
         {"fused_attn_kernel": "ignored", "gemma4_hybrid_attn_impl": "ignored"}),
        ({"tiled_mlp": True}, {"tiled_mlp": "ignored"}),
        ({"bnb_config_kwargs": {"bnb_4bit_use_double_quant": True}},
         {"bnb_config_kwargs.bnb_4bit_use_double_quant": "ignored"}),
        ({"bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}},
         {"bnb_config_kwargs.bnb_4bit_quant_type": "refused"}),
    ],
)  # fmt: skip
def test_speed_only_settings_are_ignored_and_other_numerics_refused(keys, fates):
    _, found = _translate(**keys)
    assert {k: found[k].fate for k in fates} == fates


def test_mistral_common_tokenization_is_refused_saying_what_keel_uses():
    _, found = _translate(tokenizer_use_mistral_common=True)
    assert found["tokenizer_use_mistral_common"].fate == "refused"
    assert "Hugging Face tokenizer (tokenizer.json)" in found["tokenizer_use_mistral_common"].why
    _, found = _translate(tokenizer_use_mistral_common=False)
    assert found["tokenizer_use_mistral_common"].fate == "ignored"


@pytest.mark.parametrize(
    ("extra", "saves", "evals"),
    [
        ({}, {"output.saves_per_epoch": 2}, {"train.evals_per_epoch": 4}),
        # with max_steps their fraction 1 / (N x num_epochs) is of max_steps
        ({"max_steps": 305}, {"output.save_every": 153}, {"train.eval_every": 77}),
        ({"max_steps": 100, "num_epochs": 2}, {"output.save_every": 25}, {"train.eval_every": 13}),
    ],
)
def test_per_epoch_counts_are_a_fraction_of_max_steps(extra, saves, evals):
    raw = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
    raw |= {"saves_per_epoch": 2, "evals_per_epoch": 4, "val_set_size": 0.1, **extra}
    config = translate_axolotl(raw, Path("x.yaml")).config
    for dotted, value in {**saves, **evals}.items():
        section, name = dotted.split(".")
        assert config[section][name] == value
    assert "saves_per_epoch" not in config["output"] or not extra


def test_per_epoch_counts_written_as_text_are_numbers():
    raw = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
    raw |= {"saves_per_epoch": "2", "max_steps": "305", "num_epochs": "1"}
    assert translate_axolotl(raw, Path("x.yaml")).config["output"]["save_every"] == 153
    raw.pop("max_steps")
    assert translate_axolotl(raw, Path("x.yaml")).config["output"]["saves_per_epoch"] == 2


def test_a_streamed_run_saves_once_an_epoch_at_its_end():
    raw = {"base_model": "m", "pretraining_dataset": [{"path": "c4"}], "max_steps": 305}
    translation = translate_axolotl({**raw, "saves_per_epoch": 1}, Path("x.yaml"))
    assert translation.refused() == [] and "saves_per_epoch" not in translation.config["output"]
    (fate,) = [f for f in translation.fates if f.key == "saves_per_epoch"]
    assert fate.fate == "ignored" and "keel saves at the end" in fate.why


@pytest.mark.parametrize(
    ("value", "init", "iters"),
    [
        ("pissa", "pissa", 0),  # PEFT's pissa: the exact SVD
        ("pissa_niter_4", "pissa", 4),
        ("gaussian", "gaussian", None),
        ("olora", "olora", None),
        (True, None, None),
    ],
)
def test_their_lora_init_is_method_lora_init(value, init, iters):
    axolotl, fates = _translate(adapter="lora", lora_r=8, lora_alpha=16,
                                peft_init_lora_weights=value)  # fmt: skip
    assert axolotl.refused() == []
    lora = axolotl.config["method"]["lora"]
    assert (lora.get("init"), lora.get("pissa_iters")) == (init, iters)


@pytest.mark.parametrize("value", ["corda", "eva", "pissa_niter_x", False])
def test_lora_inits_keel_does_not_have_are_refused(value):
    _, fates = _translate(adapter="lora", lora_r=8, lora_alpha=16, peft_init_lora_weights=value)
    assert fates["peft_init_lora_weights"].fate == "refused"


def test_their_lora_layers_are_method_lora_layers():
    axolotl, fates = _translate(adapter="lora", lora_r=8, lora_alpha=16,
                                peft_layers_to_transform=[3, 7], peft_layers_pattern=["layers"])  # fmt: skip
    assert axolotl.refused() == [] and axolotl.config["method"]["lora"]["layers"] == [3, 7]
    assert fates["peft_layers_pattern"].fate == "ignored"
    _, fates = _translate(adapter="lora", lora_r=8, lora_alpha=16,
                          peft_layers_to_transform=[1], peft_layers_pattern=["h"])  # fmt: skip
    assert fates["peft_layers_pattern"].fate == "refused"
