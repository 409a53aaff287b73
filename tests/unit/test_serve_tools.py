"""keel serve with tools: the tool-call readers, and the real app answering the openai client
with `tool_calls` (whole and streamed) when the generation emits a call; prompts with tools
and tool turns render as the chat template's own apply_chat_template(..., tools=...)."""

from __future__ import annotations

import json
from importlib import resources

import httpx
import openai
import pytest
from conftest import build_tiny_tokenizer, openai_weather_turns

from keel.infer.serve.limits import ServeLimits
from keel.infer.serve.scheduler import Delta, Done, EngineStats
from keel.infer.serve.server import BackgroundServer
from keel.infer.serve.tool_calls import (
    ToolCall,
    ToolCallReader,
    ToolParsing,
    split_reply,
    template_format,
)

MODEL = "fake"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HERMES = ToolParsing(format="hermes", tool_names=frozenset({"get_weather", "get_time"}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def template(name: str) -> str:
    """A chat template TRL ships (real model templates, no download)."""
    return resources.files("trl").joinpath(f"chat_templates/{name}.jinja").read_text()


def read_in_pieces(text: str, parsing: ToolParsing, size: int) -> list:
    """What a stream releases when the text arrives `size` characters at a time."""
    reader = ToolCallReader(parsing)
    pieces = []
    for start in range(0, len(text), size):
        pieces += reader.feed(text[start : start + size])
    return pieces + reader.finish()


def as_pairs(pieces) -> list:
    """Calls as (name, arguments); neighbouring text pieces joined."""
    out = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            out.append((piece.name, json.loads(piece.arguments)))
        elif out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out


def test_formats_are_picked_from_the_template_text():
    assert template_format(template("qwen2_5")) == "hermes"
    assert template_format(template("llama3_1")) == "llama3_json"
    assert template_format("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert template_format(build_tiny_tokenizer().chat_template) is None
    assert template_format(None) is None


def test_hermes_calls_with_text_around_them():
    text = f"Let me look.\n{CALL}\n{TIME_CALL}"
    content, calls = split_reply(text, HERMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    only_calls = split_reply(CALL, HERMES)
    assert only_calls[0] is None and len(only_calls[1]) == 1
    for size in (1, 2, 5, 1000):  # streamed in any pieces: the same calls and text
        assert as_pairs(read_in_pieces(text, HERMES, size)) == [
            "Let me look.",
            ("get_weather", {"city": "Paris"}),
            ("get_time", {"zone": "CET"}),
        ]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": ',  # cut off
        "a < b and <tool but no call",
    ],
)
def test_malformed_calls_stay_text(text):
    assert split_reply(text, HERMES) == (text, [])
    streamed = read_in_pieces(text, HERMES, 3)
    assert "".join(streamed) == text


def test_an_unclosed_call_that_parses_is_a_call():
    content, calls = split_reply(CALL.removesuffix("</tool_call>"), HERMES)
    assert content is None and calls[0].name == "get_weather"


def test_plain_replies_pass_through_unchanged():
    text = "No tools needed.\n\nBye. "
    assert split_reply(text, HERMES) == (text, [])
    assert "".join(read_in_pieces(text, HERMES, 2)) == text


def test_llama3_json_and_mistral_replies():
    llama = ToolParsing(format="llama3_json", tool_names=frozenset({"get_weather"}))
    content, calls = split_reply('{"name": "get_weather", "parameters": {"city": "Oslo"}}', llama)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Oslo"}
    answer = '{"name": "Ada", "parameters": {}}'  # JSON, but no offered function: text
    assert split_reply(answer, llama) == (answer, [])
    assert split_reply("Sunny.", llama) == ("Sunny.", [])
    assert as_pairs(read_in_pieces(' {"name": "get_weather", "parameters": {}}', llama, 4)) == [
        ("get_weather", {})
    ]
    mistral = ToolParsing(format="mistral", tool_names=frozenset({"a", "b"}))
    reply = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert [c.name for c in split_reply(reply, mistral)[1]] == ["a", "b"]
    without_marker = reply.removeprefix("[TOOL_CALLS]")  # decoded without special tokens
    assert [c.name for c in split_reply(without_marker, mistral)[1]] == ["a", "b"]
    assert split_reply("[1, 2]", mistral) == ("[1, 2]", [])


class ScriptedEngine:
    """Stands in for the generation engine behind the real app: every job's choices reply
    with `script` (in 3-character deltas), and the prompts it was given are kept."""

    context_length = 4096

    def __init__(self):
        self.script = ""
        self.prompts: list[list[int]] = []
        self.stats = EngineStats()
        self.adapters = self  # names() below: the base model only

    def names(self) -> list[str]:
        return [MODEL]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def cancel(self, job) -> None:
        pass

    def submit(self, job) -> None:
        self.prompts.append(list(job.prompt_ids))
        for index in range(job.first_index, job.first_index + job.n):
            for start in range(0, len(self.script), 3):
                job.sink(Delta(index, self.script[start : start + 3]))
            job.sink(Done(index, "stop", len(self.script)))


def serve(tokenizer):
    """The real app over a ScriptedEngine: {client, engine, tokenizer, url} while it runs."""
    from keel.infer.serve.app import ServeState

    engine = ScriptedEngine()
    state = ServeState(
        engine=engine, tokenizer=tokenizer, limits=ServeLimits(), default_model=MODEL
    )
    with BackgroundServer(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield {"client": client, "engine": engine, "tokenizer": tokenizer, "url": url}


@pytest.fixture(scope="module")
def served():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template("qwen2_5")
    yield from serve(tokenizer)


@pytest.fixture(scope="module")
def served_llama():
    """Llama-3.1-Instruct's template: a call is the whole reply, JSON with "parameters"."""
    tokenizer = build_tiny_tokenizer()
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": [*specials, "<|python_tag|>"]})
    tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tokenizer.chat_template = template("llama3_1")
    yield from serve(tokenizer)


def ask(served, script: str, **body):
    served["engine"].script = script
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], **body}
    return served["client"].chat.completions.create(**body)


def test_a_tool_call_comes_back_as_tool_calls(served):
    response = ask(served, CALL + "\n" + TIME_CALL, tools=[WEATHER])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id
    plain = ask(served, "It is sunny.", tools=[WEATHER]).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == "It is sunny."
    assert not plain.message.tool_calls


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(served):
    stream = ask(served, "Checking.\n" + CALL, tools=[WEATHER], stream=True)
    text, calls, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert text == "Checking."
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_") and reasons[-1] == "tool_calls"
    whole = ask(served, "Checking.\n" + CALL, tools=[WEATHER]).choices[0].message
    assert whole.content == text


def test_tool_turns_in_the_history_render_as_the_template_does(served):
    history = [
        {"role": "system", "content": "Be brief."},
        *openai_weather_turns("Paris", '{"sky": "clear"}'),
    ]
    ask(served, "Clear skies.", messages=history, tools=[WEATHER])
    expected_turns = json.loads(json.dumps(history))
    expected_turns[2]["content"] = ""
    # the arguments as a dict, as templates take them
    expected_turns[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected = served["tokenizer"].apply_chat_template(
        expected_turns, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert served["engine"].prompts[-1] == list(expected)
    rendered = served["tokenizer"].decode(expected)
    assert '"name": "get_weather"' in rendered and "<tool_response>" in rendered


def test_tool_choice_none_renders_without_tools_and_reads_no_calls(served):
    message = {"role": "user", "content": "Weather in Paris?"}
    reply = ask(served, CALL, tools=[WEATHER], tool_choice="none").choices[0]
    assert reply.message.content == CALL and not reply.message.tool_calls
    without = served["tokenizer"].apply_chat_template(
        [message], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert served["engine"].prompts[-1] == list(without)
    ask(served, "Hi", tools=[WEATHER], tool_choice="auto")
    assert b"get_weather" in served["tokenizer"].decode(served["engine"].prompts[-1]).encode()


def test_a_llama31_json_reply_comes_back_as_tool_calls_whole_and_streamed(served_llama):
    reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    choice = ask(served_llama, reply, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(ask(served_llama, reply, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ""
    [streamed] = [call for d in deltas for call in d.tool_calls or []]
    assert streamed.function.name == "get_weather" and streamed.index == 0
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = ask(served_llama, "Sunny.", tools=[WEATHER]).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == "Sunny."


def test_a_llama31_prompt_with_tools_and_a_tool_turn_renders_as_the_template_does(served_llama):
    history = openai_weather_turns("Rome", "rain")
    ask(served_llama, "Rain.", messages=history, tools=[WEATHER])
    expected_turns = json.loads(json.dumps(history))
    expected_turns[1]["content"] = ""
    expected_turns[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome"}
    expected = served_llama["tokenizer"].apply_chat_template(
        expected_turns, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert "<|start_header_id|>ipython<|end_header_id|>" in expected
    ids = served_llama["tokenizer"](expected, add_special_tokens=False)["input_ids"]
    assert served_llama["engine"].prompts[-1] == ids


def post(served, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}
    return httpx.post(f"{served['url']}/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize(
    ("body", "param", "why"),
    [
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "constrained decoding"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "constrained decoding",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        ({"functions": [WEATHER["function"]]}, "functions", "not supported"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_saying_why(served, body, param, why):
    response = post(served, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and why in error["message"], error


def test_bad_tool_turns_and_untooled_templates_are_400(served):
    bad_arguments = {"name": "get_weather", "arguments": "{oops"}
    turn = {"role": "assistant", "tool_calls": [{"type": "function", "function": bad_arguments}]}
    response = post(served, messages=[{"role": "user", "content": "Hi"}, turn])
    assert response.status_code == 400 and "arguments" in response.json()["error"]["param"]
    tokenizer = served["tokenizer"]
    qwen, tokenizer.chat_template = tokenizer.chat_template, build_tiny_tokenizer().chat_template
    try:
        response = post(served, tools=[WEATHER])
    finally:
        tokenizer.chat_template = qwen
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "tools_not_supported"
    completion = {"model": MODEL, "prompt": "Hi", "tools": [WEATHER]}
    response = httpx.post(f"{served['url']}/v1/completions", json=completion, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
