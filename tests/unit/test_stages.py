"""The stage registry: every stage is consistent end to end, and the registry is the seam.

The first tests run each registered stage through the real data pipeline, its objective
factory and one training step, and check what the step reports against the record. The
last ones register a fake stage (only in `keel.stages.registry.STAGES`) and show that
validation, data preparation and objective choice pick it up with no other file edited.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from keel.config.schema import (
    DataConfig,
    DatasetConfig,
    ModelConfig,
    OutputConfig,
    RunConfig,
    TrainConfig,
)
from keel.config.validate import check_config
from keel.data import collate, prepare_data
from keel.data.detect import spec_for_stage
from keel.data.formats import FORMATS
from keel.errors import DataError
from keel.precision import Precision
from keel.stages.base import (
    ObjectiveOutput,
    Stage,
    causal_lm_objective,
    reference_source,
    sequence_objective,
)
from keel.stages.registry import STAGES, get_stage
from keel.train.loop import Trainer
from keel.train.model_setup import make_objective
from keel.train.preference import reduce_statistics
from tests.conftest import build_tiny_model

# One row of each explicit data format, numbered so that rows differ.
ROW_OF_FORMAT = {
    "text": lambda i: {"text": f"Plain text number {i} about boats."},
    "alpaca": lambda i: {"instruction": f"Say {i}.", "output": f"{i}, said."},
    "messages": lambda i: {
        "messages": [
            {"role": "user", "content": f"Say {i}."},
            {"role": "assistant", "content": f"{i}, said."},
        ]
    },
    "preference": lambda i: {"prompt": f"Say {i}.", "chosen": f"{i}, said.", "rejected": "No."},
    "kto": lambda i: {"prompt": f"Say {i}.", "completion": f"{i}.", "label": i % 2 == 0},
    "prompt": lambda i: {"prompt": f"Say {i}.", "answer": str(i)},
}
# Settings a stage cannot default (grpo's rewards: which ones is the user's to say).
REQUIRED_SETTINGS = {"grpo": {"rewards": ["keel.rewards:format"]}}


def answered(rows: list[dict], tokenizer) -> list[dict]:
    """Prompt rows (grpo) as the rollout rows its batch source (keel.train.rollouts) builds
    each step: a fixed answer stands in for the sampled completions, +-1 for advantages."""
    out = []
    for i, row in enumerate(rows):
        completion = tokenizer(f"{i}, said.", add_special_tokens=False)["input_ids"]
        completion.append(tokenizer.eos_token_id)
        ids = row["input_ids"] + completion
        targets = [-100] * (len(row["input_ids"]) - 1) + completion + [-100]
        out.append(
            {
                "input_ids": ids,
                "targets": targets,
                "position_ids": list(range(len(ids))),
                "num_targets": len(completion),
                "advantages": [(-1.0) ** i],
            }
        )
    return out


def run_config(stage: str, tmp_path, **sections) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(tmp_path / "model")),
        data=DataConfig(datasets=[DatasetConfig(path="d.jsonl")], cutoff_len=64),
        output=OutputConfig(dir=str(tmp_path / "run")),
        train=TrainConfig(stage=stage, loss_chunk_size=16),
        **sections,
    )


def prepared_rows(stage: str, fmt: str, tokenizer, tmp_path) -> list[dict]:
    rows = [ROW_OF_FORMAT[fmt](i) for i in range(4)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_data(
        DataConfig(datasets=[DatasetConfig(path="d.jsonl", format=fmt)], cutoff_len=64),
        tokenizer,
        stage=stage,
        cache_dir=tmp_path / "cache",
        base_dir=tmp_path,
        seed=0,
        log=lambda _line: None,
    )
    return [data.train[i] for i in range(len(data.train))]


def one_step(objective, rows: list[dict], pad_id: int) -> tuple[Trainer, list[float]]:
    """One optimizer step over `rows` as one micro-batch; the step's reduced statistics."""
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)
    trainer = Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0),
        precision=Precision("fp32", "test"),
        device=torch.device("cpu"),
        pad_id=pad_id,
        max_grad_norm=0.0,
    )
    result = trainer.train_step(
        [rows],
        window_targets=sum(r["num_targets"] for r in rows),
        window_tokens=sum(len(r["input_ids"]) for r in rows),
        filler=rows[0],
    )
    return trainer, trainer.reduce_losses([result]).statistics[-1]


@pytest.mark.parametrize("name", list(STAGES))
def test_the_record_agrees_with_itself(name):
    stage = get_stage(name)
    assert stage.name == name
    assert stage.sequences_per_row == (2 if stage.unit == "pair" else 1)
    # a pair_loss is what the sequence-scoring objective hands the pairs' log-probs to (rm
    # scores its pairs with a head of its own)
    scored_pairs = stage.unit == "pair" and stage.objective is sequence_objective
    assert (stage.pair_loss is not None) == scored_pairs
    assert set(stage.formats) <= set(FORMATS)
    if stage.settings is not None:  # a keyword-only dataclass with a default for each knob
        settings = stage.settings(**REQUIRED_SETTINGS.get(name, {}))
        assert dataclasses.is_dataclass(stage.settings) and settings.problems(name) == []
        assert stage.knobs == tuple(f.name for f in dataclasses.fields(stage.settings))
    assert stage.uses_reference == ("reference" in stage.knobs)


@pytest.mark.parametrize("name", list(STAGES))
def test_data_checks_accept_exactly_the_formats_of_the_record(name, tmp_path):
    stage = get_stage(name)
    for fmt in FORMATS:
        cfg = run_config(name, tmp_path)
        cfg.data.datasets[0].format = fmt
        format_problems = [p for p in check_config(cfg) if ".format = " in p]
        if fmt in stage.formats:
            spec_for_stage(None, fmt, {}, {}, name, "d.jsonl")  # no DataError
            assert format_problems == []
        else:
            with pytest.raises(DataError, match=f"(?i){name}"):
                spec_for_stage(None, fmt, {}, {}, name, "d.jsonl")
            assert len(format_problems) == 1 and name in format_problems[0]


@pytest.mark.parametrize("name", list(STAGES))
def test_a_step_of_each_stage_logs_the_record_s_metrics(name, tiny_tokenizer, tmp_path):
    """Data in the stage's first format -> prepared rows -> its objective -> one step."""
    stage = get_stage(name)
    rows = prepared_rows(name, stage.formats[0], tiny_tokenizer, tmp_path)
    if stage.unit == "prompt":
        rows = answered(rows, tiny_tokenizer)
    assert all(len(r["labels"]) == stage.sequences_per_row for r in rows if "labels" in r)
    model = build_tiny_model(vocab_size=len(tiny_tokenizer), seed=1)
    if stage.uses_reference:  # with LoRA the reference is the policy with its adapters off
        lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
    objective = make_objective(run_config(name, tmp_path), model)
    assert objective.metric_names == stage.metric_names
    out = objective(collate(rows, tiny_tokenizer.pad_token_id))
    assert isinstance(out, ObjectiveOutput)
    trainer, statistics = one_step(objective, rows, tiny_tokenizer.pad_token_id)
    assert len(statistics) == 2 * len(stage.metric_names)
    named = reduce_statistics(trainer.inner_objective.metric_names, statistics)
    assert set(stage.metric_names) <= set(named)


@pytest.mark.parametrize(
    "name,setting,lora,want",
    [
        ("sft", "auto", False, None),
        ("orpo", "auto", False, None),
        ("dpo", "auto", True, "adapters"),
        ("dpo", "live", False, "copy"),
        ("kto", "precompute", True, "precompute"),
    ],
)
def test_one_function_decides_the_reference(name, setting, lora, want):
    stage = get_stage(name)
    settings = stage.settings(reference=setting) if stage.uses_reference else None
    assert reference_source(stage, settings, lora) == want


class _FakeObjective(torch.nn.Module):
    """A stage's own objective: the kit's cross-entropy plus one statistic of its own."""

    metric_names = ("fake/targets",)
    needs_window_statistic = False

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def set_window_statistic(self, value: float) -> None:
        raise AssertionError("unused")

    def forward(self, batch: dict, *, mode: str = "loss") -> ObjectiveOutput:
        out = self.inner(batch)
        count = out.count.float()
        return ObjectiveOutput(out.loss, out.count, torch.stack([count, torch.ones(())]))


FAKE = Stage(
    name="fake",
    summary="a stage only this test knows",
    unit="conversation",
    sequences_per_row=1,
    uses_reference=False,
    metric_names=_FakeObjective.metric_names,
    formats=("alpaca", "messages"),
    objective=lambda kit, _stage: _FakeObjective(causal_lm_objective(kit, _stage)),
)


@pytest.fixture
def fake_stage(monkeypatch):
    monkeypatch.setitem(STAGES, "fake", FAKE)
    return FAKE


def test_validation_reads_the_registry(fake_stage, tmp_path):
    (tmp_path / "model").mkdir()
    assert check_config(run_config("fake", tmp_path)) == []
    problems = check_config(run_config("faek", tmp_path))
    assert any("train.stage = 'faek'" in p and "did you mean 'fake'" in p for p in problems)
    cfg = run_config("fake", tmp_path)
    cfg.data.datasets[0].format = "sharegpt"  # not a format the fake stage lists
    assert any("format = sharegpt" in p and "fake" in p for p in check_config(cfg))
    with_dpo = run_config("fake", tmp_path, dpo=get_stage("dpo").settings(beta=1))
    assert any("dpo is set but train.stage = fake" in p for p in check_config(with_dpo))


def test_data_preparation_and_objective_choice_read_the_registry(
    fake_stage, tiny_tokenizer, tmp_path
):
    rows = prepared_rows("fake", "messages", tiny_tokenizer, tmp_path)
    assert rows and all(r["num_targets"] > 0 for r in rows)  # conversation unit: masked
    model = build_tiny_model(vocab_size=len(tiny_tokenizer), seed=1)
    objective = make_objective(run_config("fake", tmp_path), model)
    assert isinstance(objective, _FakeObjective)
    trainer, statistics = one_step(objective, rows, tiny_tokenizer.pad_token_id)
    named = reduce_statistics(trainer.inner_objective.metric_names, statistics)
    assert named == {"fake/targets": sum(r["num_targets"] for r in rows)}
