"""keel.infer.chat: one-shot and interactive chat, history and /reset."""

from __future__ import annotations

import io

import pytest
from conftest import build_tiny_model

from keel.infer import chat


@pytest.fixture
def recorder(monkeypatch):
    """Replace generation: record the messages each turn sends, stream a fixed reply."""
    seen = []

    def fake_generate(model, tokenizer, messages, *, stream=None, **gen):
        seen.append([dict(m) for m in messages])
        reply = f"reply {len(seen)}"
        for piece in ("reply ", str(len(seen))):
            stream(piece)
        return reply

    monkeypatch.setattr(chat, "generate_reply", fake_generate)
    return seen


def scripted(lines):
    it = iter(lines)

    def input_fn(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return input_fn


def test_history_kept_and_reset(recorder):
    out = io.StringIO()
    chat.interactive_chat(
        None,
        None,
        system="Be brief.",
        output=out,
        input_fn=scripted(["hi", "", "again", "/reset", "fresh", "/exit", "never"]),
    )
    system = {"role": "system", "content": "Be brief."}
    assert recorder == [
        [system, {"role": "user", "content": "hi"}],
        [
            system,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "reply 1"},
            {"role": "user", "content": "again"},
        ],
        [system, {"role": "user", "content": "fresh"}],
    ]
    text = out.getvalue()
    assert "reply 1\n" in text and "reply 3\n" in text and "cleared" in text


def test_eof_quits_and_no_system_uses_template_default(recorder):
    out = io.StringIO()
    chat.interactive_chat(None, None, system=None, output=out, input_fn=scripted(["hello"]))
    assert recorder == [[{"role": "user", "content": "hello"}]]


def test_interrupted_turn_is_dropped(monkeypatch):
    seen = []

    def fake_generate(model, tokenizer, messages, *, stream=None, **gen):
        seen.append(len(messages))
        if len(seen) == 1:
            raise KeyboardInterrupt
        return "ok"

    monkeypatch.setattr(chat, "generate_reply", fake_generate)
    out = io.StringIO()
    chat.interactive_chat(None, None, system=None, output=out, input_fn=scripted(["a", "b"]))
    assert seen == [1, 1] and "interrupted" in out.getvalue()


def test_chat_once_streams_real_model(tiny_tokenizer, capsys):
    model = build_tiny_model(len(tiny_tokenizer)).eval()
    reply = chat.chat_once(
        model, tiny_tokenizer, "Who are you?", system="Be brief.", max_new_tokens=6
    )
    assert capsys.readouterr().out == reply + "\n"
