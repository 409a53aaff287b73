"""Row formats: alpaca, sharegpt (custom tags), OpenAI messages, text; detection; bad rows."""

from __future__ import annotations

import pytest

from keel.data.formats import RowError, check_overrides, detect_format, make_spec, row_to_example
from keel.errors import DataError


def convert(row, fmt, columns=None, tags=None):
    return row_to_example(row, make_spec(fmt, columns or {}, tags or {})).content


def test_alpaca_with_input_history_and_system():
    row = {
        "instruction": "Translate to French:",
        "input": "hello world",
        "output": "Bonjour le monde.",
        "system": "You translate.",
        "history": [["Hi", "Hello!"], ["Ready?", "Yes."]],
    }
    assert convert(row, "alpaca") == [
        {"role": "system", "content": "You translate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Ready?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Translate to French:\nhello world"},
        {"role": "assistant", "content": "Bonjour le monde."},
    ]


def test_alpaca_without_optional_fields_and_renamed_columns():
    row = {"question": "2 + 2?", "answer": "4", "input": None}
    got = convert(row, "alpaca", columns={"prompt": "question", "response": "answer"})
    assert got == [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]


def test_sharegpt_with_custom_tags_and_system_column():
    row = {
        "dialog": [
            {"speaker": "client", "text": "hello"},
            {"speaker": "bot", "text": "hi"},
            {"speaker": "client", "text": "bye"},
            {"speaker": "bot", "text": "goodbye"},
        ],
        "sys": "Be polite.",
    }
    got = convert(
        row,
        "sharegpt",
        columns={"messages": "dialog", "system": "sys"},
        tags={
            "role_tag": "speaker",
            "content_tag": "text",
            "user_tag": "client",
            "assistant_tag": "bot",
        },
    )
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user", "assistant"]
    assert got[0]["content"] == "Be polite." and got[-1]["content"] == "goodbye"


def test_sharegpt_default_tags_with_system_turn():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ]
    }
    assert convert(row, "sharegpt") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]


def test_openai_messages_including_text_content_parts():
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Who "}, {"type": "text", "text": "are you?"}],
            },
            {"role": "assistant", "content": "Keel."},
        ]
    }
    assert convert(row, "messages") == [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "Keel."},
    ]


def test_text_format():
    assert convert({"text": "Once upon a time."}, "text") == "Once upon a time."
    with pytest.raises(RowError, match="empty text"):
        convert({"text": "  "}, "text")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"messages": [{"role": "user", "content": "q"}]}, "messages"),
        ({"messages": [{"from": "human", "value": "q"}]}, "sharegpt"),
        ({"conversations": [{"from": "human", "value": "q"}]}, "sharegpt"),
        ({"conversations": [{"role": "user", "content": "q"}]}, "messages"),
        ({"instruction": "q", "input": "", "output": "a"}, "alpaca"),
        ({"text": "t", "meta": 1}, "text"),
    ],
)
def test_detect_format(row, expected):
    assert detect_format(row, {}, {}, "here") == expected


def test_detect_format_uses_column_overrides_and_explains_failure():
    assert (
        detect_format({"q": "x", "a": "y"}, {"prompt": "q", "response": "a"}, {}, "here")
        == "alpaca"
    )
    with pytest.raises(DataError) as err:
        detect_format({"question": "x", "answer": "y"}, {}, {}, "data.datasets[0] (f.jsonl)")
    message = str(err.value)
    assert "f.jsonl" in message and "['answer', 'question']" in message
    assert "alpaca" in message and "sharegpt" in message and "messages" in message


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        ({"input": "x", "output": "y"}, "alpaca", "missing field 'instruction'"),
        ({"instruction": "x"}, "alpaca", "missing field 'output'"),
        ({"instruction": "x", "output": ""}, "alpaca", "empty answer"),
        ({"instruction": "x", "output": "y", "history": [["only one"]]}, "alpaca", "pair"),
        ({"instruction": "x", "output": ["a", "b"]}, "alpaca", "must be text"),
        ({"conversation": []}, "sharegpt", "missing field 'conversations'"),
        (
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
            "messages",
            "wrong role order: message 1 is assistant, expected user",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}]},
            "messages",
            "wrong role order: message 2 is user, expected assistant",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}]},
            "messages",
            "wrong role order: the conversation ends with user",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
            "messages",
            "empty answer",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
            "messages",
            "unknown role 'bot'",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "function_call", "value": "{}"},
                ]
            },
            "sharegpt",
            "tool-calling data trains with train.stage sft only",
        ),
        ({"instruction": "x", "output": "y", "videos": ["a.mp4"]}, "alpaca", "multimodal"),
        (
            {"instruction": "x <image>", "output": "y", "images": ["a.png", "b.png"]},
            "alpaca",
            '1 image placeholder(s) (\'<image>\' in the text or {"type": "image"} parts) but 2',
        ),
    ],
)
def test_bad_rows_have_clear_reasons(row, fmt, reason):
    with pytest.raises(RowError) as err:
        convert(row, fmt)
    assert reason in str(err.value)


def test_unknown_override_keys_suggest_the_closest():
    with pytest.raises(DataError, match="did you mean 'prompt'"):
        check_overrides({"promt": "q"}, {}, "data.datasets[0]")
    with pytest.raises(DataError, match="did you mean 'role_tag'"):
        check_overrides({}, {"roletag": "r"}, "data.datasets[0]")
