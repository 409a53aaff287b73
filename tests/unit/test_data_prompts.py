"""prepare_data for grpo: prompt rows (keel.data.encode_prompt) from TRL's prompt-only format,
alpaca, messages and sharegpt rows and LLaMA-Factory entries; their columns, the refusals,
over-length prompts and the cache."""

from __future__ import annotations

import json

import pytest

from keel.config.schema import (
    DataConfig,
    DatasetConfig,
    ModelConfig,
    OutputConfig,
    RunConfig,
    TrainConfig,
)
from keel.config.validate import check_config
from keel.data import prepare_data
from keel.data.detect import spec_for_stage
from keel.data.encode import EncodeSettings
from keel.data.encode_preference import encoder_for
from keel.data.encode_prompt import PromptEncoder
from keel.data.template import CHATML_TEMPLATE, ChatTemplate
from keel.errors import DataError

ROW_KEYS = {"input_ids", "num_targets", "prompt", "columns"}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture
def run(tiny_tokenizer, tmp_path):
    """run(rows, fmt=, columns=, **data) writes rows to d.jsonl and prepares them for grpo."""
    logs: list[str] = []

    def prepare(rows=None, *, fmt="auto", columns=None, path="d.jsonl", **data):
        if rows is not None:
            (tmp_path / path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        dataset = DatasetConfig(path=path, format=fmt, columns=columns or {})
        return prepare_data(
            DataConfig(datasets=[dataset], **data),
            tiny_tokenizer,
            stage="grpo",
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=logs.append,
        )

    prepare.logs = logs
    return prepare


@pytest.fixture
def chat_ids(tiny_tokenizer):
    """chat_ids(*messages): the tokenizer's own chat template with the generation prompt."""

    def ids(*messages):
        out = tiny_tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    return ids


def test_a_conversational_trl_prompt_is_the_chat_template_with_the_generation_prompt(run, chat_ids):
    messages = [{"role": "system", "content": "Be brief."}, user("What is 2+2?")]
    data = run([{"prompt": messages, "answer": "4", "level": 2, "tags": ["math", "easy"]}])
    (row,) = list(data.train)
    assert set(row) == ROW_KEYS
    assert row["input_ids"] == chat_ids(*messages)
    assert row["num_targets"] == 0
    assert json.loads(row["prompt"]) == messages  # what reward functions receive
    # every other column, with its JSON type: numbers stay numbers
    assert json.loads(row["columns"]) == {"answer": "4", "level": 2, "tags": ["math", "easy"]}


def test_a_text_trl_prompt_is_tokenized_as_is_without_eos(run, tiny_tokenizer):
    data = run([{"prompt": "2+2=", "answer": 4}])
    (row,) = list(data.train)
    assert row["input_ids"] == tiny_tokenizer("2+2=")["input_ids"]
    assert tiny_tokenizer.eos_token_id not in row["input_ids"]
    assert json.loads(row["prompt"]) == "2+2="
    assert json.loads(row["columns"]) == {"answer": 4}


def test_alpaca_builds_the_prompt_as_sft_does_and_keeps_the_output(run, chat_ids):
    row = {
        "instruction": "Add the numbers.",
        "input": "2 and 2",
        "output": "4",
        "system": "Be brief.",
        "history": [["Hi", "Hello!"]],
        "answer": 4.0,
    }
    (prepared,) = list(run([row]).train)
    messages = [
        {"role": "system", "content": "Be brief."},
        user("Hi"),
        bot("Hello!"),
        user("Add the numbers.\n2 and 2"),  # instruction and input joined, as LLaMA-Factory
    ]
    assert prepared["input_ids"] == chat_ids(*messages)
    assert json.loads(prepared["prompt"]) == messages
    assert json.loads(prepared["columns"]) == {"output": "4", "answer": 4.0}


def test_alpaca_without_an_output_column_is_a_prompt_too(run, chat_ids):
    (row,) = list(run([{"instruction": "Name a color.", "input": "", "answer": "red"}]).train)
    assert row["input_ids"] == chat_ids(user("Name a color."))
    assert json.loads(row["columns"]) == {"answer": "red"}


@pytest.mark.parametrize(
    ("conversation", "column", "fmt"),
    [
        ([user("Hi"), bot("Hello!"), user("Who are you?")], "messages", "messages"),
        (
            [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello!"},
                {"from": "human", "value": "Who are you?"},
            ],
            "conversations",
            "sharegpt",
        ),
    ],
)
def test_conversations_ending_with_the_user_are_prompts(run, chat_ids, conversation, column, fmt):
    for given in ("auto", fmt):
        data = run([{column: conversation, "system": "Be brief.", "answer": "Keel"}], fmt=given)
        (row,) = list(data.train)
        messages = [{"role": "system", "content": "Be brief."}]
        messages += [user("Hi"), bot("Hello!"), user("Who are you?")]
        assert row["input_ids"] == chat_ids(*messages)
        assert json.loads(row["prompt"]) == messages
        assert json.loads(row["columns"]) == {"answer": "Keel"}


def test_sft_conversations_are_refused_saying_how_to_convert(run):
    sft = [{"messages": [user("Hi"), bot("Hello!")]}]
    with pytest.raises(DataError, match=r"ends with the assistant's answer.*SFT data") as caught:
        run(sft)
    assert "Drop the last assistant message" in str(caught.value)
    # a later row that ends with an answer is rejected with the same advice
    rows = [{"messages": [user("Hi")]}, *sft]
    with pytest.raises(DataError, match=r"row 2: the conversation ends with the assistant"):
        run(rows)
    data = run(rows, on_invalid="skip")
    assert len(data.train) == 1 and data.report.num_rejected == 1


def test_rows_that_are_no_prompts_are_rejected_with_their_reason(run):
    rows = [
        {"prompt": "fine"},
        {"prompt": "  "},
        {"prompt": [bot("Hello!")]},
        {"prompt": [user("a"), user("b")]},
        {"prompt": None},
    ]
    data = run(rows, on_invalid="skip")
    reasons = [r.reason for r in data.report.rejections]
    assert len(data.train) == 1 and len(reasons) == 4
    assert "empty prompt" in reasons[0]
    assert "no user message" in reasons[1]
    assert "wrong role order" in reasons[2]
    assert "missing field 'prompt'" in reasons[3]


def test_detection_and_the_formats_grpo_refuses(run, tiny_tokenizer):
    with pytest.raises(DataError, match=r"cannot find prompts.*columns: \{prompt: question\}"):
        run([{"question": "2+2?", "answer": "4"}])
    (row,) = list(run([{"question": "2+2?", "answer": "4"}], columns={"prompt": "question"}).train)
    assert json.loads(row["prompt"]) == "2+2?"  # TRL's prompt-only format: text as is
    with pytest.raises(DataError, match="plain text .* holds no prompts for train.stage grpo"):
        spec_for_stage(None, "text", {}, {}, "grpo", "d.jsonl")
    with pytest.raises(DataError, match="format prompt holds prompts alone .* grpo.*sft trains"):
        spec_for_stage(None, "prompt", {}, {}, "sft", "d.jsonl")


def test_overlong_prompts_follow_data_overlength(run):
    rows = [{"prompt": "short"}, {"prompt": "word " * 40}]
    dropped = run(rows, cutoff_len=16, overlength="drop")
    assert len(dropped.train) == 1 and dropped.report.totals().dropped == 1
    with pytest.raises(DataError, match=r"1 row\(s\) longer than data.cutoff_len=16"):
        run(rows, cutoff_len=16, overlength="error")
    # truncate never cuts a prompt: the row is rejected, saying why
    with pytest.raises(DataError, match="truncate never cuts a prompt"):
        run(rows, cutoff_len=16, overlength="truncate")


def test_prompts_are_never_packed_and_the_report_counts_prompts(run):
    rows = [{"prompt": f"question {i}", "answer": i} for i in range(6)]
    data = run(rows, packing=True, val_size=2)
    assert len(data.train) == 4 and len(data.eval) == 2
    assert sorted(json.loads(r["columns"])["answer"] for r in [*data.train, *data.eval]) == list(
        range(6)
    )
    report = data.report.format()
    assert "train: 4 prompts in 4 rows" in report and "trained tokens" not in report


def _data_problems(tmp_path, stage: str, key: str, **data) -> list[str]:
    """check_config's problems about data.`key` for train.stage `stage` and these data settings."""
    cfg = RunConfig(
        model=ModelConfig(path=str(tmp_path / "model")),
        data=DataConfig(datasets=[DatasetConfig(path="d.jsonl")], **data),
        output=OutputConfig(dir=str(tmp_path / "run")),
        train=TrainConfig(stage=stage),
    )
    return [p for p in check_config(cfg) if p.startswith(f"data.{key}")]


@pytest.mark.parametrize("stage", ["grpo", "sft"])
def test_packing_is_refused_for_prompts_only(stage, tmp_path):
    packing = _data_problems(tmp_path, stage, "packing", packing=True)
    if stage == "grpo":
        assert len(packing) == 1 and "prompt rows are never packed" in packing[0]
    else:
        assert packing == []


@pytest.mark.parametrize("key", ["train_on_prompt", "mask_history"])
@pytest.mark.parametrize("stage", ["sft", "pt", "dpo", "kto", "grpo"])
def test_what_sft_trains_on_is_refused_outside_sft(key, stage, tmp_path):
    found = _data_problems(tmp_path, stage, key, **{key: True})
    if stage == "sft":
        assert found == []
    else:
        assert len(found) == 1 and f"(it is {stage}: " in found[0]


def test_train_on_prompt_and_mask_history_contradict(tmp_path):
    found = _data_problems(
        tmp_path, "sft", "train_on_prompt and", train_on_prompt=True, mask_history=True
    )
    assert len(found) == 1 and "set one of them" in found[0]


def test_the_second_prepare_loads_the_cache(run):
    rows = [{"prompt": [user("2+2?")], "answer": 4}, {"prompt": "1+1=", "answer": 2}]
    first = run(rows)
    second = run()
    assert not first.from_cache and second.from_cache
    assert list(second.train) == list(first.train)
    assert [json.loads(r["columns"]) for r in second.train] == [{"answer": 4}, {"answer": 2}]


def test_llamafactory_entries_are_prompts(tiny_tokenizer, tmp_path, chat_ids):
    alpaca = [{"q": "2+2?", "a": "4", "level": 1}]
    chat = [{"conversations": [{"from": "human", "value": "Hi"}], "answer": "Hello"}]
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    info = {
        "math": {"file_name": "alpaca.json", "columns": {"prompt": "q", "response": "a"}},
        "chat": {"file_name": "chat.json", "formatting": "sharegpt"},
        "pairs": {"file_name": "alpaca.json", "ranking": True},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))

    def prepare(*names):
        cfg = DataConfig(datasets=[DatasetConfig(path=n) for n in names], dataset_dir=".")
        return prepare_data(
            cfg,
            tiny_tokenizer,
            stage="grpo",
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda _: None,
        )

    rows = list(prepare("math", "chat").train)
    assert [r["input_ids"] for r in rows] == [chat_ids(user("2+2?")), chat_ids(user("Hi"))]
    # the answer column an entry names is not read for a prompt: it reaches the rewards
    assert [json.loads(r["columns"]) for r in rows] == [
        {"a": "4", "level": 1},
        {"answer": "Hello"},
    ]
    with pytest.raises(DataError, match="ranking: true.*preference stage"):
        prepare("pairs")


def test_grpo_encodes_with_the_prompt_encoder(tiny_tokenizer):
    """The seam: the pipeline's encoder for a prompt-unit stage is PromptEncoder."""
    spec = spec_for_stage({"prompt": "hi"}, "auto", {}, {}, "grpo", "d.jsonl")
    settings = EncodeSettings(
        stage="grpo",
        spec=spec,
        template=ChatTemplate("chatml", CHATML_TEMPLATE),
        cutoff_len=64,
        overlength="drop",
    )
    encoder = encoder_for(tiny_tokenizer, settings)
    assert isinstance(encoder, PromptEncoder)
    out = encoder({"prompt": ["hi"], "answer": [1]})
    assert out["status"] == ["ok"] and json.loads(out["columns"][0]) == {"answer": 1}
