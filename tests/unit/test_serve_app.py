"""keel serve over HTTP on a tiny model: errors are OpenAI-shaped 4xx, slots are freed, adapters
load and unload, streams equal whole answers."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from serve_support import Paused, tiny_server_state

from keel.infer.serve.limits import ServeLimits
from keel.infer.serve.server import BackgroundServer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-app")
    limits = ServeLimits(max_concurrency=2, max_tokens=128, max_adapters=2, max_lora_rank=8)
    state, model_dir, lora_dir = tiny_server_state(
        tiny_tokenizer, root, api_key=KEY, limits=limits, adapter_root=str(root)
    )
    with BackgroundServer(state) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
            yield {
                "client": client,
                "url": url,
                "model": str(model_dir),
                "lora": lora_dir,
                "engine": state.engine,
                "state": state,
                "root": root,
            }


def chat(server, timeout: float = 30, **body):
    body = {"model": server["model"], "messages": MESSAGES, "max_tokens": 8, **body}
    return server["client"].post("/v1/chat/completions", json=body, timeout=timeout)


def health(server) -> dict:
    return server["client"].get("/health").json()


def wait_until_idle(server) -> dict:
    deadline = time.monotonic() + 10
    while True:
        state = health(server)
        if state["requests_in_flight"] == 0 and state["running_sequences"] == 0:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


ANY = object()


def assert_error(response, status: int, param=ANY, code: str | None = None) -> dict:
    """The response is an OpenAI error object with this status (and param, code)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not ANY:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_models_health_and_page(server):
    client = server["client"]
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server["model"], "lora"]
    assert models["data"][1]["parent"] == server["model"]
    assert health(server)["status"] == "ok"
    page = httpx.get(server["url"] + "/")  # no key needed for the page itself
    assert page.status_code == 200 and "keel chat" in page.text
    assert "<script src" not in page.text and "cdn" not in page.text.lower()


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(server["url"] + "/v1/models", headers=headers)
        assert_error(response, 401, code="invalid_api_key")
    response = httpx.post(server["url"] + "/v1/chat/completions", json={"messages": MESSAGES})
    assert_error(response, 401, code="invalid_api_key")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 129}, "max_tokens"),  # over the server's --max-tokens
        ({"max_completion_tokens": 500}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 1e-300}, "temperature"),  # overflowed in sampling: failed the batch
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 2**64}, "seed"),  # was a 500
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_completion_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"stop": "x" * 513}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"stream": "maybe"}, "stream"),
        ({"messages": [{"role": "user", "content": "fox " * 600}]}, "messages"),  # context 512
    ],
)
def test_bad_chat_requests_are_400(server, body, param):
    error = assert_error(chat(server, **body), 400, param=param if param else ANY)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", ["", [10**6], [], ["x"] * 33, 3.5, ["ok", ""], "fox " * 600])
def test_bad_completion_requests_are_400(server, prompt):
    body = {"model": server["model"], "prompt": prompt, "max_tokens": 4}
    error = assert_error(server["client"].post("/v1/completions", json=body), 400)
    assert error["param"].startswith("prompt")


def test_unknown_model_route_and_bodies(server):
    client = server["client"]
    assert_error(chat(server, model="nope"), 404, param="model", code="model_not_found")
    assert_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_error(client.post("/v1/chat/completions", content=b"{not json"), 400)
    assert_error(client.post("/v1/chat/completions", json=[1, 2]), 400)
    for raw in ('{"temperature": NaN}', '{"top_p": Infinity}', '{"messages": "\\ud800"}'):
        assert_error(client.post("/v1/chat/completions", content=raw.encode()), 400)
    too_big = b"x" * ((1 << 20) + 1)
    assert_error(
        client.post("/v1/chat/completions", content=too_big), 413, code="request_too_large"
    )
    assert health(server)["requests_in_flight"] == 0


def sse_chunks(lines) -> list:
    chunks = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
    raise AssertionError("the stream ended without [DONE]")


def test_stream_equals_whole_and_choices_are_indexed(server):
    whole = chat(server, temperature=0, max_tokens=20).json()
    with server["client"].stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": server["model"],
            "messages": MESSAGES,
            "max_tokens": 20,
            "temperature": 0,
            "stream": True,
        },
    ) as response:
        chunks = sse_chunks(response.iter_lines())
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"] and streamed
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    body = {"model": "lora", "prompt": ["Who", "The quick"], "n": 2, "max_tokens": 5, "seed": 1}
    response = server["client"].post("/v1/completions", json=body).json()
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert response["usage"]["completion_tokens"] == 20


def stream_request(client: httpx.Client, server, max_tokens: int) -> httpx.Response:
    body = {"model": server["model"], "messages": MESSAGES, "max_tokens": max_tokens}
    body["temperature"] = 0  # the same tokens every run
    request = client.build_request("POST", "/v1/chat/completions", json={**body, "stream": True})
    return client.send(request, stream=True)


def wait_for(server, key: str, value: int) -> None:
    deadline = time.monotonic() + 10
    while health(server)[key] != value:
        assert time.monotonic() < deadline, health(server)
        time.sleep(0.05)


def test_concurrency_limit_is_429_and_a_disconnect_frees_the_slot(server):
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=30) as other:
        with Paused(server["engine"]):
            first = stream_request(other, server, 100)
            second = stream_request(server["client"], server, 100)
            assert first.status_code == second.status_code == 200
            assert health(server)["requests_in_flight"] == 2
            assert_error(chat(server), 429, code="rate_limit_exceeded")
            first.close()  # the client goes away before any token
            wait_for(server, "requests_in_flight", 1)
        chunks = sse_chunks(second.iter_lines())  # the other request is unaffected
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        second.close()
    wait_until_idle(server)


def test_disconnect_mid_stream_drops_the_sequence(server):
    before = health(server)["generated_tokens"]
    response = stream_request(server["client"], server, 120)
    for line in response.iter_lines():  # read up to the first generated text
        if line.startswith("data: {"):
            choices = json.loads(line[len("data: ") :])["choices"]
            if choices and choices[0]["delta"].get("content"):
                break
    with Paused(server["engine"]):
        response.close()
        wait_for(server, "requests_in_flight", 0)
    wait_until_idle(server)
    assert health(server)["generated_tokens"] - before < 120  # it did not run to the end


def test_disconnect_while_waiting_for_a_whole_answer(server):
    with Paused(server["engine"]):
        with pytest.raises(httpx.ReadTimeout):
            chat(server, max_tokens=100, timeout=0.3)
        wait_for(server, "requests_in_flight", 0)  # noticed without any engine progress
    wait_until_idle(server)


def test_adapters_load_and_unload_over_http(server):
    client = server["client"]
    again = {"lora_name": "again", "lora_path": str(server["lora"])}
    ok = client.post("/v1/load_lora_adapter", json=again)
    assert ok.status_code == 200 and "again" in ok.text
    assert [m["id"] for m in client.get("/v1/models").json()["data"]][-1] == "again"
    same = [chat(server, model=m, temperature=0).json() for m in ("lora", "again")]
    base = chat(server, temperature=0).json()
    texts = [r["choices"][0]["message"]["content"] for r in (*same, base)]
    assert texts[0] == texts[1] != texts[2]
    assert_error(client.post("/v1/load_lora_adapter", json=again), 400)
    missing = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "nope"})
    assert "adapter_config.json" in assert_error(missing, 400)["message"]
    assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
    assert_error(chat(server, model="again"), 404, param="model")
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "again"})
    assert_error(gone, 404, param="lora_name")


def load(server, path, name: str = "probe") -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return server["client"].post("/v1/load_lora_adapter", json=body)


def adapter_copy(server, name: str) -> Path:
    """A copy of the served adapter inside the adapter root, to spoil."""
    copy = server["root"] / name
    shutil.copytree(server["lora"], copy)
    return copy


def test_adapter_loading_stays_inside_the_root(server, tmp_path):
    outside = shutil.copytree(server["lora"], tmp_path / "outside")
    (server["root"] / "link").symlink_to(outside, target_is_directory=True)
    for path in (outside, "../" + outside.name, "link", str(server["root"] / ".." / "x")):
        error = assert_error(load(server, path), 403, param="lora_path")
        assert "outside the adapter root" in error["message"]
    state = server["state"]
    root, state.adapter_root = state.adapter_root, None
    try:  # without --adapter-root, the API manages no adapters at all
        assert_error(load(server, server["lora"]), 403, code="adapter_api_disabled")
        unload = {"lora_name": "lora"}
        disabled = server["client"].post("/v1/unload_lora_adapter", json=unload)
        assert_error(disabled, 403, code="adapter_api_disabled")
    finally:
        state.adapter_root = root


def test_bad_adapters_are_400_naming_why(server):
    from safetensors.torch import load_file, save_file

    pickled = adapter_copy(server, "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    wide = adapter_copy(server, "wide")
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 9}))
    bad_r = adapter_copy(server, "bad_r")
    (bad_r / "adapter_config.json").write_text(json.dumps({**config, "r": "eight"}))
    broken = adapter_copy(server, "broken")
    (broken / "adapter_config.json").write_text("{not json")
    truncated = adapter_copy(server, "truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    shapes = adapter_copy(server, "shapes")
    tensors = load_file(shapes / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = tensors[key][:, :-1].contiguous()  # one input feature short of the base
    save_file(tensors, shapes / "adapter_model.safetensors")
    cases = [
        (pickled, "pickle"),
        (wide, "r is 9"),
        (bad_r, "r is 'eight'"),
        (broken, "cannot read adapter_config.json"),
        (truncated, "not a valid safetensors file"),
        (shapes, "the base layer needs A [r, "),
        ("missing", "adapter_config.json"),
    ]
    for path, why in cases:
        error = assert_error(load(server, path.name if isinstance(path, Path) else path), 400)
        assert why in error["message"], (path, error)
    assert [m["id"] for m in server["client"].get("/v1/models").json()["data"]][1:] == ["lora"]
    assert load(server, server["lora"]).status_code == 200  # 2 adapters: the limit
    full = assert_error(load(server, adapter_copy(server, "third"), "third"), 400)
    assert "at most 2 adapters" in full["message"]
    assert server["client"].post("/v1/unload_lora_adapter", json={"lora_name": "probe"})
