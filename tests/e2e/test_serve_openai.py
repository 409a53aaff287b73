"""The official OpenAI client against a live `keel serve` on the bundled SmolLM2 with a LoRA.

The adapter is not trained: it is a PEFT LoRA with random non-zero A and B on q/v
projections (serve_support.random_lora), enough to change what the model answers.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_support import random_lora

from keel.infer.generate import generate_reply
from keel.infer.serve.limits import ServeLimits
from keel.infer.serve.server import BackgroundServer, ServeOptions, build_state
from keel.models.bundled import resolve_model_path

pytestmark = pytest.mark.slow
MODEL = "bundled:smollm2-135m-instruct"
KEY = "sk-keel-test"
QUESTIONS = [
    "What is the capital of France?",
    "hi",
    "Write a haiku about the sea, then explain what a haiku is in two sentences.",
    "List three fruits.",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, bundled_cache_dir):
    """One server for the module: the bundled model (converted once a session) and adapter `lora`."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve-openai")
    model_dir = resolve_model_path(MODEL, bundled_cache_dir, log=lambda message: None)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = random_lora(base, root / "lora", seed=0)
    options = ServeOptions(
        model=MODEL,
        adapters=(f"lora={lora}",),
        api_key=KEY,
        limits=ServeLimits(max_tokens=64, max_batch_size=8),
        cache_dir=str(bundled_cache_dir),
    )
    state = build_state(options, log=lambda message: None)
    with BackgroundServer(state) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield {"url": url, "client": client, "state": state}


def ask(client, question: str, **kw):
    kw = {"model": MODEL, "max_tokens": 24, "temperature": 0, **kw}
    return client.chat.completions.create(messages=[{"role": "user", "content": question}], **kw)


def health(served) -> dict:
    return httpx.get(served["url"] + "/health").json()


def test_models_lists_base_and_adapter(served):
    assert [m.id for m in served["client"].models.list().data] == [MODEL, "lora"]


def test_chat_stream_equals_whole_and_keel_chat(served):
    client = served["client"]
    whole = ask(client, QUESTIONS[0])
    text = whole.choices[0].message.content
    stream = ask(client, QUESTIONS[0], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "Paris" in text and whole.choices[0].finish_reason == "stop"
    state = served["state"]
    model, tokenizer = state.engine.adapters.model, state.tokenizer
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    assert generate_reply(model, tokenizer, messages, max_new_tokens=24) == text


def test_completions_stream_equals_whole_and_stop(served):
    client = served["client"]
    kw = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12}
    whole = client.completions.create(temperature=0, **kw)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(temperature=0, stream=True, **kw)
    )
    assert streamed == whole.choices[0].text and streamed.strip()
    full = ask(client, QUESTIONS[2], max_tokens=16).choices[0].message.content
    assert "," in full  # "In the depths of the ocean, ..."
    stopped = ask(client, QUESTIONS[2], max_tokens=16, stop=[","])
    assert stopped.choices[0].message.content == full.split(",")[0]
    assert stopped.choices[0].finish_reason == "stop"


def test_adapter_changes_the_answer(served):
    client = served["client"]
    base = ask(client, QUESTIONS[3]).choices[0].message.content
    adapted = ask(client, QUESTIONS[3], model="lora").choices[0].message.content
    assert base != adapted


def test_errors_reach_the_client_as_openai_errors(served):
    client = served["client"]
    with pytest.raises(openai.NotFoundError):
        ask(client, "hi", model="no-such-model")
    for bad in ({"max_tokens": 0}, {"max_tokens": 65}, {"temperature": 3}, {"n": 100}):
        with pytest.raises(openai.BadRequestError):
            ask(client, "hi", **bad)
    stranger = openai.OpenAI(base_url=served["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with pytest.raises(openai.AuthenticationError):
        ask(stranger, "hi")


def test_concurrent_answers_equal_answers_alone(served):
    client, engine = served["client"], served["state"].engine
    alone = [ask(client, q, max_tokens=32).choices[0].message.content for q in QUESTIONS]
    steps_before = engine.stats.steps
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(client, q, max_tokens=32), QUESTIONS))
    assert [r.choices[0].message.content for r in together] == alone
    tokens = sum(r.usage.completion_tokens for r in together)
    assert engine.stats.steps - steps_before < tokens  # decode steps were shared


def test_client_disconnect_frees_the_slot(served):
    client = served["client"]
    before = health(served)["generated_tokens"]
    stream = ask(client, QUESTIONS[2], max_tokens=64, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    deadline = time.monotonic() + 15
    while (state := health(served))["requests_in_flight"] or state["running_sequences"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert state["generated_tokens"] - before < 64
    assert ask(client, "hi", max_tokens=4).choices[0].message.content
