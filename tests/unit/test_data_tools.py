"""Tool-calling rows (LLaMA-Factory sharegpt, OpenAI messages, TRL): rendered exactly as the
chat template renders them with `tools=`, trained on the assistant's calls and answers only."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest
from conftest import build_tiny_tokenizer, openai_weather_turns

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.data.formats import RowError, make_spec
from keel.data.tools import read_example
from keel.errors import DataError

# Qwen2.5-Instruct's and Llama-3.1-Instruct's chat templates, as TRL ships them (trl is a
# dev dependency)
QWEN_TEMPLATE = resources.files("trl").joinpath("chat_templates/qwen2_5.jinja")
LLAMA_TEMPLATE = resources.files("trl").joinpath("chat_templates/llama3_1.jinja")
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
EOS = "<|im_end|>"

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# the conversation as transformers' tool-use API takes it: the reference rendering
REFERENCE = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
TRAINED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + EOS,
    "It is sunny in Paris." + EOS,
    "You are welcome." + EOS,
]

# LLaMA-Factory's sharegpt (glaive_toolcall_en_demo): a JSON call, tools as a JSON string
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": "sunny, 21 C"},
        {"from": "gpt", "value": "It is sunny in Paris."},
        {"from": "human", "value": "Thanks!"},
        {"from": "gpt", "value": "You are welcome."},
    ],
    "tools": json.dumps([WEATHER]),
}
# OpenAI: content null beside tool_calls, arguments a JSON string, ids
OPENAI = {
    "messages": [*openai_weather_turns("Paris", "sunny, 21 C"), *REFERENCE[3:]],
    "tools": TOOLS,
}
# TRL: no content beside tool_calls, dict arguments, the tool's name on its output
TRL = {
    "messages": [
        REFERENCE[0],
        {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "name": "get_weather", "content": "sunny, 21 C"},
        *REFERENCE[3:],
    ],
    "tools": TOOLS,
}


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """The tiny tokenizer with Qwen2.5-Instruct's chat template (tool-capable)."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="module")
def llama_tokenizer():
    """The tiny tokenizer with Llama-3.1-Instruct's special tokens and chat template: the
    tools in the first user turn, a call as a JSON reply, a tool's output as an ipython turn."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
    tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tokenizer.chat_template = LLAMA_TEMPLATE.read_text()
    return tokenizer


@pytest.fixture
def prepare(tmp_path):
    """prepare(tokenizer, rows or dataset_info name) -> [(input_ids, targets)] of sft."""

    def run(tokenizer, rows=None, name=None, dataset_dir=None, stage="sft"):
        if rows is not None:
            path = tmp_path / "tools.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            name = str(path)
        cfg = DataConfig(datasets=[DatasetConfig(path=name)], dataset_dir=dataset_dir)
        prepared = prepare_data(
            cfg,
            tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda message: None,
        )
        return [(list(r["input_ids"]), list(r["targets"])) for r in prepared.train]

    return run


def trained_runs(tokenizer, ids: list[int], targets: list[int]) -> list[str]:
    """Each contiguous run of trained targets, decoded."""
    runs, current = [], []
    for i, target in enumerate(targets):
        if target != -100:
            assert target == ids[i + 1]
            current.append(target)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run) for run in runs]


def reference_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(REFERENCE, tools=TOOLS, tokenize=False)
    assert "<tools>" in text and "<tool_response>\nsunny, 21 C" in text  # a real tool render
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("row", [SHAREGPT, OPENAI, TRL], ids=["sharegpt", "openai", "trl"])
def test_tool_rows_render_as_the_template_does_and_train_calls_and_answers(
    qwen_tokenizer, prepare, row
):
    [(ids, targets)] = prepare(qwen_tokenizer, [row])
    assert ids == reference_ids(qwen_tokenizer)
    runs = trained_runs(qwen_tokenizer, ids, targets)
    assert runs == TRAINED
    assert not any("sunny, 21 C" in run or "<tools>" in run for run in runs)


@pytest.mark.parametrize("row", [SHAREGPT, OPENAI, TRL], ids=["sharegpt", "openai", "trl"])
def test_llama31_tool_rows_render_as_the_template_does(llama_tokenizer, prepare, row):
    [(ids, targets)] = prepare(llama_tokenizer, [row])
    text = llama_tokenizer.apply_chat_template(REFERENCE, tools=TOOLS, tokenize=False)
    assert "Environment: ipython" in text and '"description": "The weather in a city"' in text
    assert "<|start_header_id|>ipython<|end_header_id|>" in text  # the tool's output
    assert ids == llama_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert trained_runs(llama_tokenizer, ids, targets) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is sunny in Paris.<|eot_id|>",
        "You are welcome.<|eot_id|>",
    ]


def test_pretraining_on_tool_conversations_renders_the_tools(qwen_tokenizer, prepare):
    [(ids, targets)] = prepare(qwen_tokenizer, [OPENAI], stage="pt")
    eos = qwen_tokenizer.eos_token_id
    assert ids in (reference_ids(qwen_tokenizer), [*reference_ids(qwen_tokenizer), eos])
    assert all(t != -100 for t in targets[:-1])


def test_glaive_rows_train_through_dataset_info(qwen_tokenizer, prepare, tmp_path):
    lf = tmp_path / "lf"
    lf.mkdir()
    plain = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ],
        "tools": "",  # glaive rows without tools: rendered without them
    }
    (lf / "glaive.json").write_text(json.dumps([SHAREGPT, plain]))
    entry = {
        "file_name": "glaive.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    }
    (lf / "dataset_info.json").write_text(json.dumps({"glaive_toolcall_en_demo": entry}))
    rows = prepare(qwen_tokenizer, name="glaive_toolcall_en_demo", dataset_dir="lf")
    by_length = sorted(rows, key=lambda r: len(r[0]))
    plain_ids = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        tokenize=False,
    )
    assert by_length[0][0] == qwen_tokenizer(plain_ids, add_special_tokens=False)["input_ids"]
    assert by_length[1][0] == reference_ids(qwen_tokenizer)
    assert trained_runs(qwen_tokenizer, *by_length[1]) == TRAINED


def test_parallel_calls_and_their_outputs(qwen_tokenizer, prepare):
    second = {"name": "get_weather", "arguments": {"city": "Rome"}}
    row = copy.deepcopy(SHAREGPT)
    row["conversations"][1]["value"] = json.dumps([CALL, second])
    row["conversations"][2:3] = [
        {"from": "observation", "value": "sunny, 21 C"},
        {"from": "observation", "value": "rain, 15 C"},
    ]
    reference = copy.deepcopy(REFERENCE)
    reference[1]["tool_calls"].append({"type": "function", "function": second})
    reference[2:3] = [
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "tool", "content": "rain, 15 C"},
    ]
    [(ids, targets)] = prepare(qwen_tokenizer, [row])
    text = qwen_tokenizer.apply_chat_template(reference, tools=TOOLS, tokenize=False)
    assert ids == qwen_tokenizer(text, add_special_tokens=False)["input_ids"]
    runs = trained_runs(qwen_tokenizer, ids, targets)
    assert runs[0].count("<tool_call>") == 2 and runs[1:] == TRAINED[1:]
    assert not any("rain, 15 C" in run for run in runs)


def test_a_template_without_tools_is_refused_naming_it(tiny_tokenizer, prepare):
    with pytest.raises(
        DataError,
        match=r"data.template: the model's own chat template \(tokenizer\) does not render tools",
    ):
        prepare(tiny_tokenizer, [OPENAI])


def test_rows_without_tools_are_read_as_before(tiny_tokenizer, prepare):
    row = {"messages": [REFERENCE[0], REFERENCE[3]], "tools": []}
    [(ids, _)] = prepare(tiny_tokenizer, [row])
    text = tiny_tokenizer.apply_chat_template([REFERENCE[0], REFERENCE[3]], tokenize=False)
    assert ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]


def sharegpt_with(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": r, "value": v} for r, v in turns], "tools": "[]"}


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (
            sharegpt_with(("human", "q"), ("function_call", "get_weather(Paris)")),
            "message 2 of 'conversations': the function call is not JSON",
        ),
        (
            sharegpt_with(("human", "q"), ("function_call", '{"arguments": {}}')),
            'a tool call needs {"name": ..., "arguments": {...}}',
        ),
        (
            sharegpt_with(("human", "q"), ("gpt", "a"), ("observation", "out"), ("gpt", "b")),
            "message 3 is tool, expected user (tool outputs follow an assistant turn with tool calls)",
        ),
        (
            sharegpt_with(("human", "q"), ("function_call", json.dumps(CALL)), ("gpt", "b")),
            "message 3 is assistant, expected tool",
        ),
        (
            sharegpt_with(
                ("human", "q"), ("function_call", json.dumps(CALL)), ("observation", "o")
            ),
            "the conversation ends with tool",
        ),
        (
            {"conversations": SHAREGPT["conversations"], "tools": "[{not json"},
            "field 'tools': the tool definitions are not JSON",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                "tools": json.dumps([{"description": "no name"}]),
            },
            "a tool definition needs a name",
        ),
    ],
)
def test_bad_tool_rows_have_clear_reasons(row, reason):
    with pytest.raises(RowError) as err:
        read_example(row, make_spec("sharegpt", {}, {}))
    assert reason in str(err.value)


def test_openai_arguments_must_be_a_json_object():
    row = copy.deepcopy(OPENAI)
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(RowError, match="the arguments of 'get_weather' must be a JSON object"):
        read_example(row, make_spec("messages", {}, {}))
