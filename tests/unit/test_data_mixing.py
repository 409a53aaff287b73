"""data.mix: several datasets drawn from in turn, or by weight, as LLaMA-Factory's
mix_strategy merges them with datasets.interleave_datasets (the same seed, the same rows)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data

SEED = 7


def _rows(name: str, n: int) -> list[dict]:
    return [
        {"instruction": f"{name} question {i}", "output": f"{name} answer {i}"} for i in range(n)
    ]


@pytest.fixture
def mix(tiny_tokenizer, tmp_path):
    """mix(**data) prepares a.jsonl (12 rows) and b.jsonl (4 rows); returns the instructions
    of the training samples (with their repeats) and the log."""
    for name, n in (("a", 12), ("b", 4)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _rows(name, n))
        )

    def run(**data):
        lines: list[str] = []
        prepared = prepare_data(
            DataConfig(
                datasets=[DatasetConfig(path="a.jsonl"), DatasetConfig(path="b.jsonl")], **data
            ),
            tiny_tokenizer,
            stage="sft",
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=SEED,
            log=lines.append,
        )
        texts = [tiny_tokenizer.decode(r["input_ids"]) for r in prepared.train]
        asked = Counter(re.search(r"[ab] question \d+", t).group() for t in texts)
        return asked, lines

    return run


def _theirs(mix: str, weights: list[float] | None) -> Counter:
    """What LLaMA-Factory's merge keeps: interleave_datasets over the raw rows."""
    from datasets import Dataset, interleave_datasets

    stopping = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted",
                "interleave_once": "all_exhausted_without_replacement"}[mix]  # fmt: skip
    parts = [Dataset.from_list(_rows("a", 12)), Dataset.from_list(_rows("b", 4))]
    merged = interleave_datasets(
        parts, probabilities=weights, seed=SEED, stopping_strategy=stopping
    )
    return Counter(merged["instruction"])


@pytest.mark.parametrize(
    ("how", "weights"),
    [
        ("interleave_under", None),  # in turn until b runs out: 4 of each
        ("interleave_under", [0.7, 0.3]),
        ("interleave_over", [0.5, 0.5]),  # b drawn again until a ran out
        ("interleave_once", [0.8, 0.2]),
    ],
)
def test_the_mix_draws_the_rows_their_merge_draws(mix, how, weights):
    got, lines = mix(mix=how, mix_weights=weights or [])
    want = _theirs(how, weights)
    assert got == want
    assert any(f"(data.mix {how})" in line for line in lines)
    if how == "interleave_under" and weights is None:
        assert sum(got.values()) == 8  # 4 and 4
    if how == "interleave_over":
        assert max(got.values()) > 1 and len(got) == 16  # every row, some of b's twice


def test_eval_datasets_are_mixed_alike(mix, tmp_path):
    """LLaMA-Factory merges its eval_dataset with the same mix (and needs as many weights)."""
    for name, n in (("c", 6), ("d", 2)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _rows(name, n))
        )
    held_out = [DatasetConfig(path="c.jsonl"), DatasetConfig(path="d.jsonl")]
    _, lines = mix(mix="interleave_under", eval_datasets=held_out)
    assert any("c.jsonl: 2 of 6 rows (data.mix interleave_under)" in line for line in lines)
    assert any("d.jsonl: 2 of 2 rows" in line for line in lines)


def test_concat_keeps_every_row_once(mix):
    got, _ = mix()  # the negative control: nothing is drawn
    assert sum(got.values()) == 16 and set(got.values()) == {1}
    drawn, _ = mix(mix="interleave_under", mix_weights=[0.7, 0.3])
    assert sum(drawn.values()) < 16  # and the prepared data was not served from concat's cache


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["data.mix_weights=[0.5,0.5]"], "apply to the interleave mixes"),
        (
            ["data.mix=interleave_under", "data.mix_weights=[1.0]"],
            "1 weight(s) and data.datasets 2",
        ),
        (["data.mix=interleave_over", "data.mix_weights=[0.6,0.6]"], "sum to 1"),
        (["data.mix=interleave_once", "data.mix_weights=[0.25,0.75]"], None),
    ],
)
def test_mix_settings_are_checked_before_anything_loads(tmp_path, overrides, problem):
    import yaml

    from keel.config import load_config
    from keel.errors import ConfigError

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tmp_path)},
                "data": {"datasets": ["a.jsonl", "b.jsonl"]},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    if problem is None:
        assert load_config(config, overrides).data.mix_weights == [0.25, 0.75]
        return
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides)
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_their_mix_strategy_and_interleave_probs_map_to_data_mix():
    from pathlib import Path

    from keel.config.dialects import translate

    raw = {
        "model_name_or_path": "m", "stage": "sft", "do_train": True, "dataset": "a,b",
        "template": "qwen", "finetuning_type": "lora", "output_dir": "o",
        "mix_strategy": "interleave_under", "interleave_probs": "0.7,0.3",
    }  # fmt: skip
    translation = translate(raw, Path("/tmp/x.yaml"))
    assert translation.refused() == []
    assert translation.config["data"]["mix"] == "interleave_under"
    assert translation.config["data"]["mix_weights"] == [0.7, 0.3]
    raw["mix_strategy"] = "concat"
    del raw["interleave_probs"]
    assert "mix" not in translate(raw, Path("/tmp/x.yaml")).config["data"]
