"""Evaluation data of its own in their configs: LLaMA-Factory's eval_dataset and Axolotl's
test_datasets become data.eval_datasets, read as their training datasets are."""

from __future__ import annotations

from pathlib import Path

from keel.config.dialects.axolotl import translate_axolotl
from keel.config.dialects.llamafactory import translate_llamafactory

LLAMAFACTORY = {
    "model_name_or_path": "m",
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "dataset": "alpaca_en_demo,identity",
    "max_samples": 100,
}


def test_llamafactory_eval_dataset_names_their_dataset_info_entries():
    translation = translate_llamafactory(
        {**LLAMAFACTORY, "eval_dataset": "alpaca_en_demo, glaive_toolcall_en_demo"}, Path("x.yaml")
    )
    data = translation.config["data"]
    assert data["eval_datasets"] == [
        {"path": "alpaca_en_demo", "max_samples": 100},  # their max_samples cuts each dataset
        {"path": "glaive_toolcall_en_demo", "max_samples": 100},
    ]
    assert [d["path"] for d in data["datasets"]] == ["alpaca_en_demo", "identity"]
    fates = {f.key: f for f in translation.fates}
    assert fates["eval_dataset"].fate == "mapped" and translation.refused() == []


def test_llamafactory_without_eval_dataset_writes_none():
    translation = translate_llamafactory({**LLAMAFACTORY, "eval_dataset": None}, Path("x.yaml"))
    assert "eval_datasets" not in translation.config["data"]
    assert {f.key: f.fate for f in translation.fates}["eval_dataset"] == "ignored"


def test_axolotl_test_datasets_are_read_as_their_datasets():
    raw = {
        "base_model": "m",
        "datasets": [{"path": "train.jsonl", "type": "alpaca"}],
        "test_datasets": [
            {"path": "eval.jsonl", "type": "chat_template", "field_messages": "conversations"},
            "more.jsonl",
        ],
    }
    translation = translate_axolotl(raw, Path("x.yml"))
    assert translation.config["data"]["eval_datasets"] == [
        {"path": "eval.jsonl", "format": "messages", "columns": {"messages": "conversations"}},
        {"path": "more.jsonl"},
    ]
    targets = {f.key: f.target for f in translation.fates if f.key.startswith("test_datasets")}
    assert targets["test_datasets.0.field_messages"] == "data.eval_datasets.0.columns.messages"
    assert targets["test_datasets.1"] == "data.eval_datasets.1.path"
    bad = translate_axolotl({**raw, "test_datasets": [{"path": "e.jsonl", "type": "nope"}]}, "x")
    assert [f.key for f in bad.refused()] == ["test_datasets.0.type"]
