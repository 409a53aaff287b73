"""Axolotl configs as keel configs: the whole mapping of one shipped example (golden), every
fixture (copies of Axolotl's own examples) translated with no refusal and accepted by
keel's loader, and the keys whose fate depends on their value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from config_support import model_type_folder

from keel.config import load_config
from keel.config.dialects import detect_dialect, translate
from keel.config.dialects.axolotl import translate_axolotl

FIXTURES = Path(__file__).parents[1] / "fixtures" / "dialects" / "axolotl"
CONFIGS = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".yml", ".yaml"))


def _read(path: Path, tmp_path: Path) -> dict:
    """The fixture with its placeholders filled: a bundled model and a local data file."""
    data = tmp_path / "rows.jsonl"
    data.write_text("{}\n")
    text = path.read_text().replace("{model}", "bundled:smollm2-135m-instruct")
    return yaml.safe_load(text.replace("{data}", str(data)))


def _fates(raw: dict, source: Path = FIXTURES / "x.yml") -> dict:
    return {f.key: f for f in translate_axolotl(raw, source).fates}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_each_fixture_translates_without_refusal_and_loads(path, tmp_path):
    raw = _read(path, tmp_path)
    assert detect_dialect(raw) == "axolotl"
    translation = translate(raw, path)
    assert translation.refused() == []
    assert {f.key.split(".")[0] for f in translation.fates} == set(map(str, raw))
    cfg = load_config(None, base=translation.config)
    assert cfg.model.path == "bundled:smollm2-135m-instruct"


GOLDEN_FATES = [
    ("base_model", "mapped", "model.path"),
    ("datasets.0.path", "mapped", "data.datasets.0.path"),
    ("datasets.0.type", "mapped", "data.datasets.0.format"),
    ("val_set_size", "mapped", "data.val_size"),
    ("output_dir", "mapped", "output.dir"),
    ("adapter", "mapped", "method.type"),
    ("lora_model_dir", "ignored", ""),
    ("sequence_len", "mapped", "data.cutoff_len"),
    ("sample_packing", "mapped", "data.packing"),
    ("eval_sample_packing", "ignored", ""),
    ("lora_r", "mapped", "method.lora.r"),
    ("lora_alpha", "mapped", "method.lora.alpha"),
    ("lora_dropout", "mapped", "method.lora.dropout"),
    ("lora_target_modules", "mapped", "method.lora.targets"),
    ("wandb_project", "ignored", ""),
    ("wandb_entity", "ignored", ""),
    ("wandb_watch", "ignored", ""),
    ("wandb_name", "ignored", ""),
    ("wandb_log_model", "ignored", ""),
    ("gradient_accumulation_steps", "mapped", "train.grad_accum"),
    ("micro_batch_size", "mapped", "train.micro_batch_size"),
    ("num_epochs", "mapped", "train.epochs"),
    ("optimizer", "mapped", "train.optimizer"),
    ("lr_scheduler", "mapped", "train.scheduler"),
    ("learning_rate", "mapped", "train.lr"),
    ("bf16", "mapped", "train.precision"),
    ("tf32", "ignored", ""),
    ("gradient_checkpointing", "mapped", "train.gradient_checkpointing"),
    ("resume_from_checkpoint", "ignored", ""),
    ("logging_steps", "mapped", "output.log_every"),
    ("attn_implementation", "mapped", "model.attn_implementation"),
    ("loss_watchdog_threshold", "ignored", ""),
    ("loss_watchdog_patience", "ignored", ""),
    ("warmup_ratio", "mapped", "train.warmup_ratio"),
    ("evals_per_epoch", "mapped", "train.evals_per_epoch"),
    ("saves_per_epoch", "mapped", "output.saves_per_epoch"),
    ("weight_decay", "mapped", "train.weight_decay"),
    ("special_tokens.pad_token", "ignored", ""),
]
GOLDEN_CONFIG = {
    "train": {
        "stage": "sft",
        "grad_accum": 2,
        "micro_batch_size": 2,
        "epochs": 1,
        "optimizer": "adamw_8bit",
        "scheduler": "cosine",
        "lr": 0.0002,
        "precision": "auto",
        "gradient_checkpointing": True,
        "warmup_ratio": 0.1,
        "weight_decay": 0.0,
        "evals_per_epoch": 4,
    },
    "model": {"path": "{model}", "attn_implementation": "auto"},
    "data": {
        "datasets": [{"path": "{data}", "format": "alpaca"}],
        "val_size": 0.1,
        "cutoff_len": 2048,
        "packing": True,
    },
    "output": {"dir": "./outputs/lora-out", "log_every": 1, "saves_per_epoch": 1},
    "method": {
        "type": "lora",
        "lora": {
            "r": 16,
            "alpha": 32,
            "dropout": 0.05,
            "targets": [
                "gate_proj",
                "down_proj",
                "up_proj",
                "q_proj",
                "v_proj",
                "k_proj",
                "o_proj",
            ],
        },
    },
}


def test_golden_mapping_of_llama3_lora_1b():
    path = FIXTURES / "llama-3-lora-1b.yml"
    translation = translate_axolotl(yaml.safe_load(path.read_text()), path)
    assert [(f.key, f.fate, f.target) for f in translation.fates] == GOLDEN_FATES
    assert all(f.why for f in translation.fates if f.fate != "mapped")
    assert translation.config == GOLDEN_CONFIG
    assert translation.notes == []


def test_no_adapter_is_full_fine_tuning_noted():
    translation = translate_axolotl({"base_model": "m", "datasets": [{"path": "d"}]}, FIXTURES)
    assert translation.config["method"] == {"type": "full"}
    assert translation.config["output"]["dir"] == "./model-out"
    assert any("method.type = full" in note for note in translation.notes)


def test_unknown_and_unsupported_keys_are_refused():
    raw = {
        "base_model": "m",
        "datasets": [{"path": "d", "type": "chat_template.argilla"}, {"path": "e", "type": {}}],
        "made_up_key": 1,
        "optimizer": "lion_8bit",
        "lr_scheduler": "rex",
        "load_in_4bit": True,
        "special_tokens": {"bos_token": "<s>"},
    }
    refused = {f.key for f in translate_axolotl(raw, FIXTURES).refused()}
    assert refused == {
        "datasets.0.type",
        "datasets.1.type",
        "made_up_key",
        "optimizer",
        "lr_scheduler",
        "load_in_4bit",
        "special_tokens.bos_token",
    }


def test_chat_template_dataset_keys_become_columns_and_tags():
    raw = {
        "base_model": "m",
        "rl": "dpo",
        "rl_beta": 0.2,
        "datasets": [
            {
                "path": "d",
                "type": "chat_template.default",
                "field_messages": "conversation",
                "field_tools": "functions",
                "field_chosen": "good",
                "message_property_mappings": {"role": "from", "content": "value"},
                "roles": {"user": ["human"], "assistant": ["gpt"]},
            }
        ],
    }
    t = translate_axolotl(raw, FIXTURES)
    assert t.refused() == []
    assert t.config["data"]["datasets"] == [
        {
            "path": "d",
            "format": "messages",
            "columns": {"messages": "conversation", "tools": "functions", "chosen": "good"},
            "tags": {
                "role_tag": "from",
                "content_tag": "value",
                "user_tag": "human",
                "assistant_tag": "gpt",
            },
        }
    ]
    assert t.config["train"]["stage"] == "dpo" and t.config["dpo"] == {"beta": 0.2}


def test_precision_from_bf16_and_fp16():
    def precision(**keys):
        t = translate_axolotl({"base_model": "m", **keys}, FIXTURES)
        return t.config["train"].get("precision"), [f.key for f in t.refused()]

    assert precision(bf16="auto") == ("auto", [])
    assert precision(bf16=True, fp16=False) == ("bf16", [])
    assert precision(bf16=False, fp16=True) == ("fp16", [])
    assert precision(bf16=False, fp16=False) == ("fp32", [])
    assert precision(bf16=True, fp16=True) == ("bf16", ["fp16"])


def test_grpo_trl_section_and_reward_functions(tmp_path):
    (tmp_path / "rewards.py").write_text("def accuracy_reward(completions, **kw): ...\n")
    raw = {
        "base_model": "m",
        "rl": "grpo",
        "sample_packing": True,
        "datasets": [{"path": "d", "type": "chat_template"}],
        "trl": {
            "beta": 0.04,
            "num_generations": 4,
            "max_completion_length": 64,
            "reward_funcs": ["rewards.accuracy_reward", "keel.rewards.format"],
            "reward_weights": [1.0, 0.5],
            "use_vllm": True,
        },
    }
    t = translate_axolotl(raw, tmp_path / "config.yml")
    assert t.refused() == []
    assert t.config["grpo"] == {
        "beta": 0.04,
        "num_generations": 4,
        "max_completion_length": 64,
        "rewards": ["rewards.py:accuracy_reward", "keel.rewards:format"],
        "reward_weights": [1.0, 0.5],
    }
    assert "packing" not in t.config["data"]
    assert _fates(raw, tmp_path / "config.yml")["trl.use_vllm"].fate == "ignored"


def test_fsdp_and_deepspeed_become_distributed_settings(tmp_path):
    fsdp = translate_axolotl(
        {
            "base_model": "m",
            "fsdp": ["full_shard", "auto_wrap"],
            "fsdp_config": {"fsdp_offload_params": True, "fsdp_version": 2},
        },
        FIXTURES,
    )
    assert fsdp.config["distributed"] == {"strategy": "fsdp", "fsdp": {"cpu_offload": True}}
    ds = tmp_path / "zero3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    zero3 = translate_axolotl({"base_model": "m", "deepspeed": str(ds)}, FIXTURES)
    assert zero3.config["distributed"] == {"strategy": "fsdp"}
    assert zero3.refused() == []


def test_learning_rate_written_as_yaml_text_is_a_number():
    raw = yaml.safe_load("base_model: m\nlearning_rate: 2e-5\n")
    assert raw["learning_rate"] == "2e-5"  # YAML 1.1: no dot, so text
    assert translate_axolotl(raw, FIXTURES).config["train"]["lr"] == 2e-5


def test_typos_and_unknown_nested_keys_are_refused_naming_the_likely_key():
    raw = {
        "base_model": "m",
        "lora_rr": 8,
        "learnig_rate": 2e-4,
        "wandb_projet": None,  # empty: changes nothing, but the typo is still named
        "datasets": [{"path": "d", "type": "chat_template", "field_mesages": "conv"}],
        "fsdp_config": {"fsdp_offload_param": True, "nested": {"deeper": 1}},
    }
    fates = _fates(raw)
    refused = {key: f.why for key, f in fates.items() if f.fate == "refused"}
    assert set(refused) == {
        "lora_rr",
        "learnig_rate",
        "datasets.0.field_mesages",
        "fsdp_config.fsdp_offload_param",
        "fsdp_config.nested",
    }
    assert refused["lora_rr"].endswith("did you mean `lora_r`?")
    assert refused["learnig_rate"].endswith("did you mean `learning_rate`?")
    assert refused["datasets.0.field_mesages"].endswith("did you mean `field_messages`?")
    assert refused["fsdp_config.fsdp_offload_param"].endswith("did you mean `offload_params`?")
    assert fates["wandb_projet"].fate == "ignored"
    assert "did you mean `wandb_project`?" in fates["wandb_projet"].why


def test_empty_values_are_their_defaults_not_refusals():
    raw = {
        "base_model": "m",
        "optimizer": None,
        "gradient_checkpointing": None,
        "lr_scheduler": None,
    }
    t = translate_axolotl(raw, FIXTURES)
    assert t.refused() == []
    assert "optimizer" not in t.config["train"] and "scheduler" not in t.config["train"]


def test_axolotl_defaults_that_differ_from_keels_are_written():
    raw = {"base_model": "m", "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "datasets": ["d"]}
    t = translate_axolotl(raw, FIXTURES)
    assert t.refused() == []
    assert t.config["data"]["cutoff_len"] == 512
    assert t.config["method"]["lora"] == {"r": 8, "alpha": 16, "dropout": 0.0}
    assert "data.cutoff_len = 512: Axolotl's default sequence_len" in t.notes


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_lora_r_and_alpha_have_no_axolotl_default_so_leaving_them_out_is_refused(adapter):
    # Axolotl hands PEFT lora_r and lora_alpha as the config holds them: left out or empty,
    # its run stops when the adapter is made; keel says so instead of using its own default
    raw = {"base_model": "m", "adapter": adapter, "load_in_4bit": adapter == "qlora"}
    refused = {f.key: f.why for f in translate_axolotl(raw, FIXTURES).refused()}
    assert set(refused) == {"lora_r", "lora_alpha"}
    assert (
        refused["lora_r"].startswith("left out: Axolotl has no default")
        and "16" in refused["lora_r"]
    )
    raw.update(lora_r=None, lora_alpha=32)
    refused = {f.key: f.why for f in translate_axolotl(raw, FIXTURES).refused()}
    assert list(refused) == ["lora_r"] and refused["lora_r"].startswith("empty: ")


def test_lora_r_left_empty_without_an_adapter_changes_nothing():
    fates = _fates({"base_model": "m", "lora_r": None, "datasets": ["d"]})
    assert fates["lora_r"].fate == "ignored" and "lora_alpha" not in fates


@pytest.mark.parametrize(
    ("template", "model_type", "fate"),
    [
        ("qwen_25", "llama", "refused"),
        ("llama3", "qwen2", "refused"),
        ("qwen_25", "qwen2", "mapped"),
        ("llama3", "llama", "mapped"),
        ("gemma3", "gemma3_text", "mapped"),
    ],
)
def test_a_family_chat_template_is_checked_against_the_models_type(
    template, model_type, fate, tmp_path
):
    raw = {"base_model": str(model_type_folder(tmp_path, model_type)), "chat_template": template}
    translation = translate_axolotl(raw, FIXTURES)
    found = {f.key: f for f in translation.fates}["chat_template"]
    assert found.fate == fate
    if fate == "refused":
        assert f"is a {model_type} model" in found.why
        assert "set chat_template: tokenizer_default" in found.why
        assert "template" not in translation.config.get("data", {})
    else:
        assert f"model_type {model_type}" in found.why
        assert translation.config["data"]["template"] == "auto"


@pytest.mark.parametrize(
    ("keys", "fates"),
    [
        ({"train_on_inputs": False}, {"train_on_inputs": "mapped"}),
        ({"train_on_inputs": True}, {"train_on_inputs": "mapped"}),
        ({"train_on_inputs": True, "rl": "dpo"}, {"train_on_inputs": "ignored"}),
        ({"save_strategy": "steps", "save_steps": 10}, {"save_strategy": "ignored"}),
        (
            {"peft_use_rslora": True, "loraplus_lr_ratio": 16, "loraplus_lr_embedding": 1e-6},
            {"peft_use_rslora": "mapped", "loraplus_lr_ratio": "mapped"},
        ),
        ({"cosine_min_lr_ratio": 0.1}, {"cosine_min_lr_ratio": "mapped"}),
        ({"lora_modules_to_save": ["embed_tokens", "lm_head"]}, {"lora_modules_to_save": "mapped"}),
        ({"lora_modules_to_save": None}, {"lora_modules_to_save": "ignored"}),
        ({"lora_model_dir": "out/sft"}, {"lora_model_dir": "mapped"}),
        (
            {"reward_model": True, "num_labels": 1, "center_rewards_coefficient": 0.01},
            {"num_labels": "ignored", "center_rewards_coefficient": "mapped"},
        ),
        ({"num_labels": 2}, {"num_labels": "refused"}),
        ({"reward_model": True, "num_labels": 2}, {"num_labels": "refused"}),
        ({"center_rewards_coefficient": 0.01}, {"center_rewards_coefficient": "ignored"}),
        ({"eval_batch_size": 4}, {"eval_batch_size": "ignored"}),
        ({"shuffle_merged_datasets": True}, {"shuffle_merged_datasets": "ignored"}),
        ({"dataset_exact_deduplication": True}, {"dataset_exact_deduplication": "mapped"}),
        ({"shuffle_merged_datasets": False}, {"shuffle_merged_datasets": "ignored"}),
        ({"curriculum_sampling": True}, {"curriculum_sampling": "refused"}),
        (
            {"curriculum_sampling": True, "shuffle_merged_datasets": False},
            {"curriculum_sampling": "mapped", "shuffle_merged_datasets": "ignored"},
        ),
        (
            {"datasets": [{"path": "d.jsonl", "type": "bradley_terry.chat_template"}]},
            {"datasets.0.type": "refused"},  # a reward model's pairs only
        ),
        (
            {"cosine_min_lr_ratio": 0.1, "lr_scheduler": "linear"},
            {"cosine_min_lr_ratio": "ignored"},
        ),
        (
            {"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
            {"lr_scheduler": "mapped", "lr_scheduler_kwargs": "mapped"},
        ),
        ({"save_strategy": "epoch"}, {"save_strategy": "refused"}),
        ({"fsdp_version": 2}, {"fsdp_version": "ignored"}),
        ({"eot_tokens": ["<end_of_turn>"]}, {"eot_tokens": "ignored"}),
        ({"processor_type": "AutoProcessor"}, {"processor_type": "ignored"}),
        (
            {
                "plugins": [
                    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin",
                    "axolotl.integrations.liger.LigerPlugin",
                    "axolotl.integrations.diffusion.DiffusionPlugin",
                ],
                "liger_rms_norm": True,
                "liger_use_token_scaling": True,
                "lora_mlp_kernel": True,
            },
            {
                "plugins.0": "ignored",
                "plugins.1": "ignored",
                "plugins.2": "refused",
                "liger_rms_norm": "ignored",
                "liger_use_token_scaling": "refused",
                "lora_mlp_kernel": "ignored",
            },
        ),
        ({"chat_template": "qwen3_5"}, {"chat_template": "mapped"}),
        ({"chat_template": "tokenizer_default_fallback_chatml"}, {"chat_template": "mapped"}),
        ({"chat_template": "metharme"}, {"chat_template": "refused"}),
        # their settings keel has no key for: ignored at their defaults, refused otherwise
        (
            {"save_safetensors": True, "use_ray": False},
            {"save_safetensors": "ignored", "use_ray": "ignored"},
        ),
        ({"save_safetensors": False}, {"save_safetensors": "refused"}),
        ({"sample_packing_bin_size": 200}, {"sample_packing_bin_size": "ignored"}),
        # its default (random new embedding rows) is not keel's (their mean): never ignored
        ({"mean_resizing_embeddings": False}, {"mean_resizing_embeddings": "refused"}),
    ],
)
def test_keys_of_their_other_examples(keys, fates):
    found = _fates({"base_model": "m", **keys})
    assert {key: found[key].fate for key in fates} == fates


def test_the_lora_variants_and_the_floor_land_in_keels_keys():
    raw = {
        "base_model": "m",
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "peft_use_rslora": True,
        "loraplus_lr_ratio": "16",
        "learning_rate": "2e-4",
        "lr_scheduler": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr": 2e-5},
    }
    translation = translate_axolotl(raw, FIXTURES)
    assert translation.refused() == []
    lora, train = translation.config["method"]["lora"], translation.config["train"]
    assert (lora["rslora"], lora["plus_lr_ratio"]) == (True, 16.0)
    assert (train["scheduler"], train["min_lr_ratio"]) == ("cosine", pytest.approx(0.1))


def test_a_bradley_terry_reward_model_reads_their_columns_and_trims_as_they_do():
    raw = {
        "base_model": "m",
        "reward_model": True,
        "center_rewards_coefficient": 0.01,
        "datasets": [{"path": "bt.jsonl", "type": "bradley_terry.chat_template"}],
    }
    translation = translate_axolotl(raw, FIXTURES)
    assert translation.refused() == []
    config = translation.config
    assert config["train"]["stage"] == "rm" and config["rm"] == {"center_rewards_coefficient": 0.01}
    (dataset,) = config["data"]["datasets"]
    assert dataset == {"path": "bt.jsonl", "format": "preference", "columns": {"prompt": "input"}}
    assert config["data"]["overlength"] == "truncate"
    raw["datasets"].append({"path": "pairs.jsonl", "type": "chat_template"})  # not theirs alone
    assert "overlength" not in translate_axolotl(raw, FIXTURES).config["data"]


def test_completion_text_is_cut_into_pieces_as_they_cut_it():
    raw = {"base_model": "m", "datasets": [{"path": "c.jsonl", "type": "completion"}]}
    translation = translate_axolotl(raw, FIXTURES)
    config = translation.config
    assert config["train"]["stage"] == "pt" and config["data"]["overlength"] == "split"
    assert any(note.startswith("data.overlength = split") for note in translation.notes)
    raw["datasets"].append({"path": "chat.jsonl", "type": "chat_template"})  # sft: not cut
    assert "overlength" not in translate_axolotl(raw, FIXTURES).config["data"]


def test_min_sample_len_drops_short_samples_and_pieces_where_they_read_it():
    raw = {"base_model": "m", "datasets": [{"path": "c.jsonl", "type": "completion"}]}
    raw["min_sample_len"] = 200
    translation = translate_axolotl(raw, FIXTURES)
    assert translation.config["data"]["min_len"] == 200
    assert _fates(raw)["min_sample_len"].fate == "mapped"
    dpo = {"base_model": "m", "rl": "dpo", "min_sample_len": 200}  # their RL data: not read
    assert _fates(dpo)["min_sample_len"].fate == "ignored"
    assert "min_len" not in translate_axolotl(dpo, FIXTURES).config.get("data", {})


def test_data_files_pick_files_of_the_hub_dataset_or_of_a_local_folder(tmp_path):
    """Their data_files are load_dataset's: files inside the repo `path` names (the ALST
    recipes' Long-Data-Collections), or inside a local folder."""
    hub = {"path": "togethercomputer/Long-Data-Collections", "type": "completion"}
    raw = {"base_model": "m", "datasets": [{**hub, "data_files": ["pretrain/a.jsonl"]}]}
    (entry,) = translate_axolotl(raw, tmp_path / "x.yml").config["data"]["datasets"]
    assert entry["path"] == hub["path"] and entry["files"] == ["pretrain/a.jsonl"]
    (tmp_path / "local").mkdir()  # the same keys on a folder beside the config
    raw["datasets"] = [{"data_files": "b.jsonl", "path": "local", "type": "completion"}]
    (entry,) = translate_axolotl(raw, tmp_path / "x.yml").config["data"]["datasets"]
    assert entry["path"] == "local/b.jsonl" and "files" not in entry
    raw["datasets"][0]["data_files"] = ["b.jsonl", "c.jsonl"]
    assert _fates(raw, tmp_path / "x.yml")["datasets.0.data_files"].fate == "refused"
    streamed = {"base_model": "m", "pretraining_dataset": [{"data_files": "d/*.jsonl", **hub}]}
    streamed["pretraining_dataset"][0]["type"] = "pretrain"
    (entry,) = translate_axolotl(streamed, tmp_path / "x.yml").config["data"]["datasets"]
    assert entry["path"] == hub["path"] and entry["files"] == ["d/*.jsonl"]


def test_pretraining_dataset_is_streamed_plain_text_cut_into_pieces():
    raw = {
        "base_model": "m",
        "max_steps": 100,
        "sample_packing": True,
        "pretrain_multipack_attn": True,
        "streaming_multipack_buffer_size": 10000,
        "pretraining_dataset": [
            {"path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "type": "pretrain",
             "text_column": "body", "split": "train"},
        ],
    }  # fmt: skip
    translation = translate_axolotl(raw, FIXTURES)
    assert translation.refused() == []
    config = translation.config
    assert config["train"]["stage"] == "pt"
    assert config["data"]["streaming"] is True and config["data"]["overlength"] == "split"
    assert config["data"]["datasets"] == [
        {
            "format": "text",
            "path": "HuggingFaceFW/fineweb-edu",
            "subset": "sample-10BT",
            "columns": {"prompt": "body"},
            "split": "train",
        }
    ]
    raw["pretraining_dataset"][0]["type"] = "ebft_pretrain.transform"
    raw["pretrain_multipack_attn"] = False
    refused = {f.key for f in translate_axolotl(raw, FIXTURES).refused()}
    assert refused == {"pretraining_dataset.0.type", "pretrain_multipack_attn"}
    raw = {
        "base_model": "m",
        "streaming": True,
        "datasets": [{"path": "a.jsonl", "type": "alpaca"}],
    }
    assert translate_axolotl(raw, FIXTURES).config["data"]["streaming"] is True


def test_their_8bit_optimizers_and_activation_offloading():
    raw = {
        "base_model": "m",
        "optimizer": "adamw_torch_8bit",
        "gradient_checkpointing": True,
        "activation_offloading": True,
    }
    train = translate_axolotl(raw, FIXTURES).config["train"]
    assert train["optimizer"] == "adamw_8bit"
    assert train["gradient_checkpointing"] == "offload"
    raw.update(optimizer="paged_adamw_32bit", activation_offloading="disk")
    t = translate_axolotl(raw, FIXTURES)
    assert t.config["train"]["optimizer"] == "adamw"
    assert [f.key for f in t.refused()] == ["activation_offloading"]


def test_simpo_refuses_trl_cpo_default_sft_term_unless_cpo_alpha_is_zero():
    raw = {"base_model": "m", "rl": "simpo", "rl_beta": 2.0, "simpo_gamma": 0.5}
    t = translate_axolotl(raw, FIXTURES)
    [refused] = t.refused()
    assert refused.key == "cpo_alpha" and "set cpo_alpha: 0" in refused.why
    t = translate_axolotl({**raw, "cpo_alpha": 0}, FIXTURES)
    assert t.refused() == [] and t.config["simpo"] == {"beta": 2.0, "gamma": 0.5}
    assert [f.key for f in translate_axolotl({**raw, "cpo_alpha": None}, FIXTURES).refused()] == [
        "cpo_alpha"
    ]


@pytest.mark.parametrize(
    ("keys", "stage", "beta", "ignored"),
    [
        ({"rl": "orpo", "rl_beta": 0.2}, "orpo", 0.2, []),
        ({"rl": "orpo", "orpo_alpha": 0.3}, "orpo", 0.3, []),
        ({"rl": "orpo", "rl_beta": 0.2, "orpo_alpha": 0.3}, "orpo", 0.2, ["orpo_alpha"]),
        ({"rl": "dpo", "rl_beta": 0.2, "trl": {"beta": 0.4}}, "dpo", 0.4, ["rl_beta"]),
    ],
)
def test_the_beta_comes_from_trl_beta_then_rl_beta_then_orpo_alpha(keys, stage, beta, ignored):
    t = translate_axolotl({"base_model": "m", **keys}, FIXTURES)
    assert t.refused() == [] and t.config[stage] == {"beta": beta}
    assert [f.key for f in t.fates if f.fate == "ignored"] == ignored


def test_sharegpt_named_messages_read_human_and_gpt_as_axolotl_does_by_default():
    dataset = {
        "path": "d",
        "type": "chat_template",
        "field_messages": "conversations",
        "message_property_mappings": {"role": "from", "content": "value"},
    }
    t = translate_axolotl({"base_model": "m", "datasets": [dataset]}, FIXTURES)
    assert t.config["data"]["datasets"][0]["tags"] == {
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
    }
    assert any(note.startswith("data.datasets.0.tags: user_tag human") for note in t.notes)
    openai_named = {"path": "d", "type": "chat_template"}
    t = translate_axolotl({"base_model": "m", "datasets": [openai_named]}, FIXTURES)
    assert "tags" not in t.config["data"]["datasets"][0]


def test_special_tokens_equal_to_the_tokenizer_s_own_are_ignored_others_refused(tmp_path):
    model = model_type_folder(tmp_path, "llama")
    (model / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "unk_token": "<unk>"})
    )
    tokens = {"bos_token": "<s>", "unk_token": "<unk>", "pad_token": "</s>", "sep_token": "|"}
    fates = _fates({"base_model": str(model), "special_tokens": tokens})
    assert fates["special_tokens.bos_token"].fate == "ignored"
    assert "'<s>' is the tokenizer's own bos_token" in fates["special_tokens.bos_token"].why
    assert fates["special_tokens.unk_token"].fate == "ignored"
    assert fates["special_tokens.pad_token"].fate == "ignored"
    assert fates["special_tokens.sep_token"].fate == "refused"
    assert "it has no sep_token, this asks for '|'" in fates["special_tokens.sep_token"].why
    (model / "tokenizer_config.json").unlink()  # an older tokenizer: its special tokens map
    (model / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    older = _fates({"base_model": str(model), "special_tokens": {"bos_token": "<s>"}})
    assert older["special_tokens.bos_token"].fate == "ignored"
    other = _fates({"base_model": str(model), "special_tokens": {"bos_token": "<|begin|>"}})
    refused = other["special_tokens.bos_token"]
    assert refused.fate == "refused"
    assert "its bos_token is '<s>', this asks for '<|begin|>'" in refused.why


def test_their_own_jinja_template_becomes_data_template(tmp_path):
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    inline = translate_axolotl({"base_model": "m", "chat_template": "jinja",
                                "chat_template_jinja": text}, FIXTURES)  # fmt: skip
    assert inline.refused() == [] and inline.config["data"]["template"] == text
    left_out = translate_axolotl({"base_model": "m", "chat_template_jinja": "t.jinja"}, FIXTURES)
    assert left_out.refused() == [] and left_out.config["data"]["template"] == "t.jinja"
    fates = {f.key: f for f in left_out.fates}
    assert fates["chat_template_jinja"].target == "data.template"
    missing = _fates({"base_model": "m", "chat_template": "jinja"})
    assert missing["chat_template"].fate == "refused"
    assert "jinja needs chat_template_jinja" in missing["chat_template"].why
    unused = translate_axolotl(
        {"base_model": "m", "chat_template": "chatml", "chat_template_jinja": text}, FIXTURES
    )
    assert unused.config["data"]["template"] == "chatml"
    assert {f.key: f for f in unused.fates}["chat_template_jinja"].fate == "ignored"


def test_a_dataset_name_is_the_hub_dataset_s_configuration():
    raw = {
        "base_model": "bundled:smollm2-135m-instruct",
        "datasets": [{"path": "owner/data", "name": "en", "type": "alpaca"}],
    }
    translation = translate_axolotl(raw, FIXTURES)
    assert translation.refused() == []
    assert translation.config["data"]["datasets"][0]["subset"] == "en"
    assert load_config(None, base=translation.config).data.datasets[0].subset == "en"


def test_lora_model_dir_decides_the_lora_shape_as_peft_loads_it():
    raw = {"base_model": "m", "adapter": "lora", "lora_model_dir": "out/sft", "lora_dropout": 0.1}
    translation = translate_axolotl(raw, FIXTURES)
    assert translation.refused() == []  # no lora_r / lora_alpha needed: the adapter has them
    assert translation.config["model"]["adapter"] == "out/sft"
    assert translation.config["method"]["lora"] == {"dropout": 0.1}
