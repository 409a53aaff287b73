"""data.eval_datasets: evaluation data of its own, prepared as the training data is (the same
formats, checks and encoding), never mixed into training, reported and cached apart."""

from __future__ import annotations

import json
import re

import pytest

from keel.config.load import load_config
from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import ConfigError, DataError


def conversation(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i} " * (1 + i % 3)},
        ]
    }


def pair(i: int) -> dict:
    return {"prompt": f"question {i}", "chosen": f"yes {i}", "rejected": f"no {i} " * 2}


def kto(i: int) -> dict:
    return {"prompt": f"question {i}", "completion": f"answer {i}", "label": i % 2 == 0}


@pytest.fixture
def run(tiny_tokenizer, tmp_path):
    """run(train_rows, eval_rows, **data): each written to its file, then prepared (eval
    rows None: no eval_datasets)."""

    def prepare(train_rows, eval_rows=None, *, stage="sft", files=("t.jsonl", "e.jsonl"), **data):
        for name, rows in zip(files, (train_rows, eval_rows)):
            if rows is not None:
                (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        if eval_rows is not None:
            data.setdefault("eval_datasets", [DatasetConfig(path=files[1])])
        config = DataConfig(datasets=[DatasetConfig(path=files[0])], **data)
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


def _ids(dataset) -> list[list[int]]:
    return sorted(list(row["input_ids"]) for row in dataset)


def test_the_eval_rows_are_the_eval_files_encoded_as_training_rows_would_be(run):
    train_rows, eval_rows = (
        [conversation(i) for i in range(8)],
        [conversation(i) for i in (20, 21, 22)],
    )
    data = run(train_rows, eval_rows)
    alone = run(eval_rows, files=("e.jsonl", "unused.jsonl"))  # the eval file as training data
    assert len(data.train) == 8 and len(data.eval) == 3
    assert _ids(data.eval) == _ids(alone.train)
    assert _ids(data.train) == _ids(run(train_rows).train)  # nothing held out of, or mixed in
    assert (data.report.train.samples, data.report.eval.samples) == (8, 3)
    text = data.report.format()
    assert "e.jsonl (eval)" in text and "  eval: 3 samples" in text


def test_cached_apart_from_the_same_files_used_otherwise(run, tmp_path):
    train_rows, eval_rows = [conversation(i) for i in range(6)], [conversation(i) for i in (30, 31)]
    first = run(train_rows, eval_rows)
    assert run(train_rows, eval_rows).from_cache
    assert run(train_rows, eval_rows).report.format() == first.report.format()
    swapped = run(eval_rows, train_rows, files=("e.jsonl", "t.jsonl"))  # the same two files
    assert not swapped.from_cache and swapped.fingerprint != first.fingerprint
    assert (len(swapped.train), len(swapped.eval)) == (2, 6)


def test_preference_and_kto_eval_data(run, tiny_tokenizer):
    dpo = run([pair(i) for i in range(6)], [pair(i) for i in (40, 41)], stage="dpo")
    assert (dpo.report.train.samples, dpo.report.eval.samples) == (6, 2)
    labelled = run([kto(i) for i in range(6)], [kto(i) for i in (50, 51, 52)], stage="kto")
    assert labelled.report.eval.samples == 3
    # each eval sample's KL sequence pairs its prompt with another eval sample's answer
    kl_texts = [tiny_tokenizer.decode(row["kl_input_ids"]) for row in labelled.eval]
    answers = {int(n) for text in kl_texts for n in re.findall(r"answer (\d+)", text)}
    assert answers == {50, 51, 52}


def test_bad_eval_data_is_refused_naming_it(run):
    with pytest.raises(DataError, match=r"data.eval_datasets\[0\] \(e.jsonl\): file not found"):
        run(
            [conversation(0)],
            files=("t.jsonl", "e.jsonl"),
            eval_datasets=[DatasetConfig(path="e.jsonl")],
        )
    with pytest.raises(DataError, match=r"no usable samples in data.eval_datasets"):
        run([conversation(0)], [{"messages": []}], on_invalid="skip")


def test_val_size_and_eval_datasets_together_are_refused(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps(conversation(0)) + "\n")
    config = {
        "model": {"path": "bundled:smollm2-135m-instruct"},
        "data": {
            "datasets": [{"path": str(tmp_path / "t.jsonl")}],
            "eval_datasets": [{"path": str(tmp_path / "t.jsonl")}],
            "val_size": 0.1,
        },
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError, match="data.val_size = 0.1 and data.eval_datasets both"):
        load_config(None, base=config)
