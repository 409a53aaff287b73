"""Chat templates and masking: exactly the assistant turns (+ EOS) are trained on."""

from __future__ import annotations

import copy
import json

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.data.template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    encode_pt,
    encode_sft,
    resolve_template,
    shift_targets,
)
from keel.errors import DataError

EOS = "<|im_end|>"


def trained_runs(tokenizer, input_ids, targets) -> list[str]:
    """Decode each contiguous run of trained targets, checking they are pre-shifted."""
    runs, current = [], []
    for i, t in enumerate(targets):
        if t != -100:
            assert t == input_ids[i + 1], "targets[i] must be input_ids[i + 1]"
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def encode(tokenizer, messages, template=None):
    template = template or ChatTemplate("tokenizer", tokenizer.chat_template)
    ids, mask = encode_sft(tokenizer, template, messages)
    return ids, shift_targets(ids, mask)


def test_single_turn_trains_on_answer_and_eos_only(tiny_tokenizer):
    ids, targets = encode(
        tiny_tokenizer,
        [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Keel."},
        ],
    )
    assert trained_runs(tiny_tokenizer, ids, targets) == [f"I am Keel.{EOS}"]
    assert targets[-1] == -100
    text = tiny_tokenizer.decode(ids)
    assert text.endswith(f"I am Keel.{EOS}\n")  # the newline after EOS is input, not a target


def test_every_assistant_turn_is_trained_in_multi_turn(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "What is your name?"},
        {"role": "assistant", "content": "My name is Keel."},
        {"role": "user", "content": "Give three tips"},
        {"role": "assistant", "content": "Eat well, sleep enough, and move."},
    ]
    ids, targets = encode(tiny_tokenizer, messages)
    runs = trained_runs(tiny_tokenizer, ids, targets)
    assert runs == [f"hi{EOS}", f"My name is Keel.{EOS}", f"Eat well, sleep enough, and move.{EOS}"]
    joined = "".join(runs)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] not in joined


def test_default_system_prompt_is_input_not_target(tiny_tokenizer):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    ids, targets = encode(tiny_tokenizer, messages)
    assert "You are a helpful assistant." in tiny_tokenizer.decode(ids)
    assert trained_runs(tiny_tokenizer, ids, targets) == [f"hi{EOS}"]
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    ids, targets = encode(tiny_tokenizer, with_system)
    text = tiny_tokenizer.decode(ids)
    assert "Be brief." in text and "helpful assistant" not in text
    assert trained_runs(tiny_tokenizer, ids, targets) == [f"hi{EOS}"]


def test_builtin_chatml_has_no_default_system(tiny_tokenizer):
    template = ChatTemplate("chatml", CHATML_TEMPLATE)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    ids, targets = encode(tiny_tokenizer, messages, template)
    assert (
        tiny_tokenizer.decode(ids)
        == f"<|im_start|>user\nhello{EOS}\n<|im_start|>assistant\nhi{EOS}\n"
    )
    assert trained_runs(tiny_tokenizer, ids, targets) == [f"hi{EOS}"]


def test_turn_end_without_eos_trims_trailing_whitespace(tiny_tokenizer):
    # turns end with <|endoftext|> (not the tokenizer's EOS) and a blank line
    text = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|endoftext|>\n\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    ids, targets = encode(tiny_tokenizer, messages, ChatTemplate("custom", text))
    assert trained_runs(tiny_tokenizer, ids, targets) == ["hi there<|endoftext|>"]


def test_resolve_template_variants(tiny_tokenizer, tmp_path):
    assert resolve_template("auto", tiny_tokenizer, tmp_path) == (
        ChatTemplate("tokenizer", tiny_tokenizer.chat_template),
        None,
    )
    assert resolve_template("chatml", tiny_tokenizer, tmp_path)[0].text == CHATML_TEMPLATE
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert (
        resolve_template("t.jinja", tiny_tokenizer, tmp_path)[0].text
        == "{{ messages[0]['content'] }}"
    )
    with pytest.raises(DataError, match="not auto, chatml"):
        resolve_template("llama3", tiny_tokenizer, tmp_path)
    with pytest.raises(DataError, match="not found"):
        resolve_template("missing.jinja", tiny_tokenizer, tmp_path)
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    template, note = resolve_template("auto", bare, tmp_path)
    assert template.name == "chatml" and "no chat template" in note


def test_pt_encoding_appends_eos_and_trains_every_token(tiny_tokenizer):
    ids, mask = encode_pt(tiny_tokenizer, "The quick brown fox.")
    assert ids[-1] == tiny_tokenizer.eos_token_id and all(mask)
    targets = shift_targets(ids, mask)
    assert targets == ids[1:] + [-100]


# --- through prepare_data -------------------------------------------------------------


def _prepare(tmp_path, tokenizer, rows, logs=None, **data):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(datasets=[DatasetConfig(path="d.jsonl")], **data)
    return prepare_data(
        cfg,
        tokenizer,
        stage="sft",
        cache_dir=tmp_path / "cache",
        base_dir=tmp_path,
        seed=0,
        log=(logs.append if logs is not None else lambda s: None),
    )


CONVERSATION = {
    "messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Keel."},
    ]
}


PLAIN = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|im_end|>{% endif %}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def test_jinja_file_template_through_prepare_data(tiny_tokenizer, tmp_path):
    (tmp_path / "plain.jinja").write_text(PLAIN)
    data = _prepare(tmp_path, tiny_tokenizer, [CONVERSATION], template="plain.jinja")
    row = data.train[0]
    # (transformers renders with trim_blocks: the newline right after a block tag is dropped)
    assert tiny_tokenizer.decode(row["input_ids"]).startswith(
        "### user:\nhello\n### assistant:\nhi"
    )
    assert trained_runs(tiny_tokenizer, row["input_ids"], row["targets"]) == [
        f"hi{EOS}",
        f"I am Keel.{EOS}",
    ]
    assert data.report.template == "plain.jinja"


def test_an_inline_template_encodes_as_the_same_template_in_a_file(tiny_tokenizer, tmp_path):
    """data.template holding the Jinja text itself (Axolotl's chat_template_jinja)."""
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "plain.jinja").write_text(PLAIN)
    from_file = _prepare(tmp_path / "file", tiny_tokenizer, [CONVERSATION], template="plain.jinja")
    inline = _prepare(tmp_path, tiny_tokenizer, [CONVERSATION], template=PLAIN)
    assert inline.report.template == "inline"
    for key in ("input_ids", "targets"):
        assert inline.train[0][key] == from_file.train[0][key]
    assert resolve_template(PLAIN, tiny_tokenizer, tmp_path)[0] == ChatTemplate("inline", PLAIN)


def test_tokenizer_without_template_falls_back_to_chatml(tiny_tokenizer, tmp_path):
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    logs = []
    data = _prepare(tmp_path, bare, [CONVERSATION], logs=logs)
    assert any("builtin chatml" in line for line in logs)
    assert data.report.template == "chatml"
    text = bare.decode(data.train[0]["input_ids"])
    assert text.startswith("<|im_start|>user\nhello") and "helpful assistant" not in text


def test_template_that_rewrites_history_is_a_data_error(tiny_tokenizer, tmp_path):
    # like reasoning templates that drop earlier thoughts: the last turn renders differently
    (tmp_path / "rewrite.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if loop.last and m['role'] == 'assistant' %}(final) {% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(DataError) as err:
        _prepare(tmp_path, tiny_tokenizer, [CONVERSATION], template="rewrite.jinja")
    assert "d.jsonl row 1" in str(err.value) and "data.template" in str(err.value)


# --- an answer's reasoning (reasoning_content, thinking) ---------------------------------

# Qwen3's way: the reasoning of the answers after the last user turn, in <think>
THINKS = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last %}"
    "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GPT_OSS_STYLE = THINKS.replace("m.reasoning_content", "m.thinking")


@pytest.mark.parametrize("field", ["reasoning_content", "thinking"])
@pytest.mark.parametrize("template", [THINKS, GPT_OSS_STYLE])
def test_an_answers_reasoning_is_rendered_and_trained(tiny_tokenizer, tmp_path, field, template):
    row = {
        "messages": [
            {"role": "user", "content": "Add 2 and 3.", field: None},
            {"role": "assistant", "content": "5", field: "2 plus 3 is 5"},
        ]
    }
    data = _prepare(tmp_path, tiny_tokenizer, [row], template=template)
    runs = trained_runs(tiny_tokenizer, data.train[0]["input_ids"], data.train[0]["targets"])
    assert runs == [f"<think>2 plus 3 is 5</think>5{EOS}"]


@pytest.mark.parametrize(
    ("messages", "template", "why"),
    [  # a template that reads neither field: the reasoning would be lost
        ([("user", "Q", None), ("assistant", "A", "because")], CHATML_TEMPLATE, "does not render"),
        # Qwen3's drops the reasoning of answers before the last user turn
        (
            [("user", "Q", None), ("assistant", "A", "because"), ("user", "Q2", None),
             ("assistant", "B", None)],
            THINKS,
            "drops it in this turn",
        ),
        ([("user", "Q", "hmm"), ("assistant", "A", None)], THINKS, "a user message holds reasoning"),
    ],
)  # fmt: skip
def test_reasoning_that_would_be_lost_is_refused(tiny_tokenizer, tmp_path, messages, template, why):
    row = {
        "messages": [
            {"role": role, "content": content, **({"reasoning_content": r} if r else {})}
            for role, content, r in messages
        ]
    }
    with pytest.raises(DataError, match=why):
        _prepare(tmp_path, tiny_tokenizer, [row], template=template)
