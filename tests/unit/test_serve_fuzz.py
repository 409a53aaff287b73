"""keel serve under random request bodies: never a 500, never an effect on another request.

A seeded fuzzer sets fields of valid chat and completion bodies to junk (wrong types,
huge, negative, NaN and infinite numbers, lone surrogates, long strings, nested lists)
while a well-formed greedy request runs alongside; its answer must stay its solo answer.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_support import tiny_server_state

from keel.infer.serve.limits import ServeLimits
from keel.infer.serve.server import BackgroundServer

FUZZ_REQUESTS = 120
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "tools", "response_format", "user",
]  # fmt: skip


def junk(rng: random.Random, depth: int = 0):
    """One random JSON-ish value; floats may be NaN or infinite (json.dumps writes them)."""
    numbers = [0, 1, -1, 2, 7, 16, 17, 2**31, 2**63, 2**64, -(2**64), 10**40, 10**4000 // 10**3990]
    floats = [0.0, 1e-300, 5e-324, -0.0, 0.5, 1.0, 2.0, 2.0000001, 1e308, float("nan")]
    floats += [float("inf"), -float("inf"), -1e-300, 1e-2, 0.0099]
    strings = ["", " ", "a", "hi", "\ud800", "\x00", "🙂" * 50, "x" * rng.randint(0, 20000)]
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice(numbers)
    if kind == 1:
        return rng.choice(floats)
    if kind == 2:
        return rng.choice(strings)
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return [rng.randrange(-5, 2000) for _ in range(rng.randrange(0, 50))]  # token ids
    if kind == 5:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if kind == 6:
        return {rng.choice(FIELDS + ["role", "content", "type", "text"]): junk(rng, depth + 1)}
    return [{"role": rng.choice(["user", "system", "robot"]), "content": junk(rng, depth + 1)}]


NAN, INF = float("nan"), float("inf")
# Values at and just past each field's edges, so that a body is often valid but for one.
EDGES = {
    "temperature": [0, 1e-300, 5e-324, 0.0099, 0.01, 2, 2.0000001, NAN, INF, -0.0, 1, True],
    "top_p": [0, 1e-300, 1, 1.0000001, NAN, -INF, 0.5],
    "seed": [0, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30],
    "max_tokens": [0, 1, 16, 17, -1, 2**63, True, 1.0, None, "3"],
    "max_completion_tokens": [0, 1, 16, 17, None, -(2**70)],
    "n": [0, 1, 2, 8, 9, -1, 2**64, True],
    "stop": ["", "a", ["a"] * 5, "x" * 600, ["\ud800"], [None], 5, [".", "!"]],
    "prompt": ["", [], [[]], [0], [-1], [10**6], ["a"] * 17, [[1, 2], [3]], "\ud800", 3.5],
    "messages": [
        [],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "assistant", "content": "x" * 3000}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ],
    "stream": [True, False, "true", 1],
    "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, None, []],
    "logprobs": [None, False, 0, True, 5],
}


def fuzzed_body(rng: random.Random, model: str) -> tuple[str, str]:
    chat = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": 6}
    if chat:
        body["messages"] = [{"role": "user", "content": "Who are you?"}]
    else:
        body["prompt"] = "The quick brown fox"
    for key in rng.sample(FIELDS, rng.randint(1, 3)):
        edges = EDGES.get(key)
        body[key] = rng.choice(edges) if edges and rng.random() < 0.7 else junk(rng)
    route = "/v1/chat/completions" if chat else "/v1/completions"
    return route, json.dumps(body)  # NaN/Infinity written as such; "\ud800" as an escape


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-fuzz")
    limits = ServeLimits(max_tokens=16, max_concurrency=64)
    state, model_dir, _ = tiny_server_state(tiny_tokenizer, root, limits=limits)
    with BackgroundServer(state) as url:
        yield url, str(model_dir)


def test_random_fields_never_give_a_500_nor_touch_another_request(server):
    url, model = server
    good = {
        "model": model,
        "messages": [{"role": "user", "content": "Give three tips"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        solo = client.post("/v1/chat/completions", json=good).json()
        expected = solo["choices"][0]["message"]["content"]
        stop = threading.Event()
        answers: list[str] = []

        def well_formed() -> None:
            while not stop.is_set():
                reply = client.post("/v1/chat/completions", json=good)
                answers.append(reply.json()["choices"][0]["message"]["content"])

        def fuzz(seed: int) -> tuple[int, str, str]:
            route, body = fuzzed_body(random.Random(seed), model)
            reply = client.post(route, content=body, headers={"content-type": "application/json"})
            return reply.status_code, reply.text, body

        beside = threading.Thread(target=well_formed)
        beside.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(fuzz, range(FUZZ_REQUESTS)))
        finally:
            stop.set()
            beside.join(timeout=60)
    bad = [(status, text[:300], body[:300]) for status, text, body in results if status >= 500]
    bad += [(s, t[:300], b[:300]) for s, t, b in results if "server_error" in t]
    assert not bad
    statuses = {status for status, _, _ in results}
    assert 200 in statuses and 400 in statuses  # both kinds were exercised
    assert answers and all(answer == expected for answer in answers)
