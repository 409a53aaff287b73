"""Their chat, api and export configs (LLaMA-Factory) and training configs (Axolotl) as the
flags of keel chat, serve and export: each key's fate, their defaults, and the command line
winning over the file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from keel.cli import parse_args
from keel.cli_their import fill_from_their_config
from keel.config.dialects.commands import translate_command
from keel.errors import ConfigError

SOURCE = Path("their.yaml")
INFERENCE = {
    "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507",
    "adapter_name_or_path": "saves/qwen3-4b/lora/sft",
    "template": "qwen3_nothink",
    "infer_backend": "huggingface",
    "trust_remote_code": True,
}
MERGE = {
    **{k: v for k, v in INFERENCE.items() if k != "infer_backend"},
    "export_dir": "saves/qwen3_sft_merged",
    "export_size": 5,
    "export_device": "cpu",
    "export_legacy_format": False,
}


def _fates(translation) -> dict[str, str]:
    return {f.key: f.fate for f in translation.fates}


def test_llamafactory_chat_takes_their_sampling_defaults():
    translation = translate_command(INFERENCE, SOURCE, "chat")
    assert translation.config == {
        "model": "Qwen/Qwen3-4B-Instruct-2507",
        "adapter": "saves/qwen3-4b/lora/sft",
        "max_new_tokens": 1024,
        "temperature": 0.95,
        "top_p": 0.7,
    }
    assert translation.refused() == []
    greedy = translate_command({**INFERENCE, "do_sample": False, "top_p": 0.9}, SOURCE, "chat")
    assert greedy.config["temperature"] == 0.0 and greedy.config["top_p"] == 0.9


def test_llamafactory_export_and_serve():
    export = translate_command(MERGE, SOURCE, "export")
    assert export.config == {
        "model": "Qwen/Qwen3-4B-Instruct-2507",
        "adapter": "saves/qwen3-4b/lora/sft",
        "out": "saves/qwen3_sft_merged",
        "max_shard_size": "5GB",
    }
    assert export.refused() == [] and _fates(export)["export_device"] == "ignored"
    legacy = translate_command({**MERGE, "export_legacy_format": True}, SOURCE, "export")
    assert [f.key for f in legacy.refused()] == ["export_legacy_format"]
    served = translate_command({**INFERENCE, "infer_backend": "vllm"}, SOURCE, "serve")
    assert served.config == {
        "model": "Qwen/Qwen3-4B-Instruct-2507",
        "adapter": ["sft=saves/qwen3-4b/lora/sft"],  # served as model "sft" beside the base
        "backend": "vllm",
    }


def test_llamafactory_null_keys_are_their_defaults():
    translation = translate_command({**INFERENCE, "adapter_name_or_path": None}, SOURCE, "chat")
    assert "adapter" not in translation.config and translation.refused() == []


def test_llamafactory_refusals_name_each_key():
    raw = {**INFERENCE, "adapter_name_or_path": "a,b", "num_beams": 4, "lora_rnak": 8}
    refused = {f.key: f.why for f in translate_command(raw, SOURCE, "chat").refused()}
    assert set(refused) == {"adapter_name_or_path", "num_beams", "lora_rnak"}
    assert "merge the others into the base first" in refused["adapter_name_or_path"]
    with pytest.raises(ConfigError, match="neither a LLaMA-Factory config"):
        translate_command({"model": {"path": "m"}}, SOURCE, "chat")


@pytest.mark.parametrize("adapter", ["lora", None])
def test_axolotl_training_config_names_what_it_trained(adapter):
    raw = {"base_model": "NousResearch/Llama-3.2-1B", "output_dir": "./outputs/lora-out"}
    raw |= {"adapter": adapter, "lora_r": 16, "learning_rate": 2e-4}
    chat = translate_command(raw, SOURCE, "chat")
    export = translate_command(raw, SOURCE, "export")
    predict = translate_command(raw, SOURCE, "predict")
    assert predict.config == chat.config | {"out": str(Path("./outputs/lora-out") / "predict")}
    assert any("come from --data" in note for note in predict.notes)
    if adapter:
        assert chat.config == {"model": raw["base_model"], "adapter": "./outputs/lora-out"}
    else:
        assert chat.config == {"model": "./outputs/lora-out"}
    assert export.config["out"] == str(Path("./outputs/lora-out") / "merged")
    assert chat.refused() == [] and _fates(chat)["learning_rate"] == "ignored"


def _args(command: str, *argv: str) -> argparse.Namespace:
    return parse_args([command, *argv])


def test_the_command_line_wins_and_keel_defaults_fill_the_rest(tmp_path, capsys):
    config = tmp_path / "inference.yaml"
    config.write_text("model_name_or_path: m\ndo_sample: false\n")
    args = _args("chat", str(config), "--max-new-tokens", "7", "--model", "other")
    fill_from_their_config(args, "chat")
    assert (args.model, args.max_new_tokens, args.temperature, args.top_p) == ("other", 7, 0.0, 1.0)
    assert "note: --model as the command line gives it" in capsys.readouterr().err
    plain = _args("export", "--model", "m", "--out", "o")
    fill_from_their_config(plain, "export")
    assert plain.max_shard_size == 5 * 10**9  # keel's default, 5GB
    with pytest.raises(ConfigError, match="keel serve needs --model"):
        fill_from_their_config(_args("serve"), "serve")
    with pytest.raises(ConfigError, match="settings of a config; name the config"):
        fill_from_their_config(_args("chat", "--model", "m", "temperature=1"), "chat")
