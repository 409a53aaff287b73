"""Preference rows whose prompt column repeats the start of whole chosen/rejected
conversations (argilla's and UltraFeedback's binarized sets; Axolotl's
chat_template.argilla): `columns: {prompt: ""}` reads the pairs once, as the same pairs
written with the prompt apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.config.dialects.axolotl import translate_axolotl
from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import DataError

QA = [("What is 2+2?", "4", "5"), ("Capital of France?", "Paris", "Rome")]


def whole(q: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]


REPEATED = [{"prompt": q, "chosen": whole(q, a), "rejected": whole(q, b)} for q, a, b in QA]
APART = [{"prompt": q, "chosen": a, "rejected": b} for q, a, b in QA]


@pytest.fixture
def pairs(tiny_tokenizer, tmp_path):
    def run(rows, **columns):
        path = tmp_path / f"rows-{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        entry = DatasetConfig(path=str(path), format="preference", columns=columns)
        prepared = prepare_data(
            DataConfig(datasets=[entry]),
            tiny_tokenizer,
            stage="dpo",
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda _: None,
        )
        return sorted(tuple(row["input_ids"]) for row in prepared.train)

    return run


def test_the_repeated_prompt_is_read_once(pairs):
    assert pairs(REPEATED, prompt="") == pairs(APART)
    with pytest.raises(DataError, match="invalid row"):  # read as given: two user turns
        pairs(REPEATED)


def test_text_answers_without_a_prompt_column_are_refused(pairs):
    with pytest.raises(DataError, match="columns.prompt is empty"):
        pairs(APART, prompt="")


def test_axolotls_argilla_type_reads_them_so():
    raw = {
        "base_model": "m",
        "rl": "orpo",
        "datasets": [{"path": "d.jsonl", "type": "chat_template.argilla"}],
    }
    translation = translate_axolotl(raw, Path("x.yml"))
    assert translation.config["data"]["datasets"] == [
        {"path": "d.jsonl", "format": "preference", "columns": {"prompt": ""}}
    ]
    assert translation.refused() == []
