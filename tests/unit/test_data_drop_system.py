"""data.datasets[].drop_system: the rows' system prompts are left out before they are
rendered (Axolotl's drop_system_message), in every format that holds one."""

from __future__ import annotations

import json

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data

SYSTEM = "You are a pirate."


@pytest.fixture
def run(tiny_tokenizer, tmp_path):
    def prepare(rows, *, stage="sft", **entry):
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = DataConfig(datasets=[DatasetConfig(path=str(path), **entry)], template="chatml")
        return prepare_data(
            config,
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda line: None,
        )

    return prepare


def _texts(data, tokenizer) -> list[str]:
    return [tokenizer.decode(row["input_ids"]) for row in data.train]


ROWS = {
    "messages": [
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "ahoy"},
            ]
        }
    ],
    "sharegpt": [
        {
            "conversations": [
                {"from": "system", "value": SYSTEM},
                {"from": "human", "value": "hello"},
                {"from": "gpt", "value": "ahoy"},
            ]
        }
    ],
    "alpaca": [{"instruction": "hello", "output": "ahoy", "system": SYSTEM}],
}


@pytest.mark.parametrize("fmt", ROWS)
def test_the_system_prompt_is_left_out_only_when_asked(fmt, run, tiny_tokenizer):
    kept = _texts(run(ROWS[fmt]), tiny_tokenizer)
    dropped = _texts(run(ROWS[fmt], drop_system=True), tiny_tokenizer)
    assert SYSTEM in kept[0] and SYSTEM not in dropped[0]
    assert "hello" in dropped[0] and "ahoy" in dropped[0]


def test_preference_rows_lose_the_system_of_their_prompt(run, tiny_tokenizer):
    pair = {
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "ahoy"}],
        "rejected": [{"role": "assistant", "content": "no"}],
    }
    kept = _texts(run([pair], stage="dpo"), tiny_tokenizer)
    dropped = _texts(run([pair], stage="dpo", drop_system=True), tiny_tokenizer)
    assert SYSTEM in kept[0] and SYSTEM not in dropped[0]


def test_the_setting_keys_the_cache(run):
    assert run(ROWS["messages"]).fingerprint != run(ROWS["messages"], drop_system=True).fingerprint
