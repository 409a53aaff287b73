"""The web chat at `/` in real headless Chromium (Playwright): stream, history, system prompt,
adapter picker, stop button. Skips, saying why, when Playwright or Chromium is missing."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
from serve_support import Paused, tiny_server_state

from keel.infer.serve.server import BackgroundServer

KEY = "web-key"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; keel's dev extra has it)")
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip(
        f"no Chromium found (looked for {', '.join(BROWSERS)}); "
        "install it, e.g. apt-get install chromium (make test tries this when run as root)"
    )


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import Error, sync_playwright

    executable = find_chromium()
    with sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(executable_path=executable, headless=True)
        except Error as e:
            pytest.skip(f"Chromium at {executable} did not start: {e}")
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-web")
    state, model_dir, _ = tiny_server_state(tiny_tokenizer, root, api_key=KEY)
    with BackgroundServer(state) as url:
        yield {"url": url, "model": str(model_dir), "engine": state.engine}


def api_answer(server, messages, model) -> str:
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    response = httpx.post(
        server["url"] + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    return response.json()["choices"][0]["message"]["content"]


def send(page, text: str) -> str:
    """Type `text`, press Enter, wait for the answer to finish; return the answer shown."""
    answers = page.locator(".msg.assistant .body")
    count = answers.count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "n => document.querySelectorAll('.msg.assistant').length > n"
        " && !document.getElementById('send').disabled",
        arg=count,
    )
    return answers.nth(count).inner_text()


def test_web_chat_streams_keeps_history_switches_adapter_and_stops(browser, server, tmp_path):
    page = browser.new_page()
    bodies = []
    page.on(
        "request",
        lambda r: (
            bodies.append(json.loads(r.post_data))
            if r.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.goto(server["url"] + "/")
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.querySelectorAll('#model option').length === 2")
    assert page.locator("#model option").all_inner_texts() == [server["model"], "lora (adapter)"]
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "12")
    page.click("summary")
    page.fill("#system", "You are terse.")
    # Record every text the answer bubble shows while it arrives (from the mutation
    # records, so chunks that arrive together in one network read still count one by one).
    page.evaluate(
        """() => { window.shown = [];
        new MutationObserver((records) => {
            for (const r of records) for (const n of r.addedNodes)
                if (n.nodeType === Node.TEXT_NODE && r.target.closest('.assistant'))
                    window.shown.push(n.data);
        }).observe(document.getElementById('log'), {subtree: true, childList: true});
        }"""
    )
    first = send(page, "Who are you?")
    shown = [text for text in page.evaluate("window.shown") if text]
    assert len(shown) >= 3 and shown[-1] == first  # it grew piece by piece
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))
    system = {"role": "system", "content": "You are terse."}
    question = {"role": "user", "content": "Who are you?"}
    assert first == api_answer(server, [system, question], server["model"]) and first
    second = send(page, "And then?")
    assert bodies[-1]["messages"] == [
        system,
        question,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And then?"},
    ]
    assert second == api_answer(server, bodies[-1]["messages"], server["model"])

    page.click("#clear")
    page.select_option("#model", "lora")
    adapted = send(page, "Who are you?")
    assert bodies[-1]["model"] == "lora" and bodies[-1]["messages"] == [system, question]
    assert adapted == api_answer(server, [system, question], "lora") != first
    page.screenshot(path=str(tmp_path / "web-chat.png"), full_page=True)

    with Paused(server["engine"]):  # no token arrives until Stop is pressed
        page.fill("#prompt", "Tell me a long story.")
        page.press("#prompt", "Enter")
        page.wait_for_function("!document.getElementById('stop').disabled")
        page.click("#stop")
        page.wait_for_function("document.getElementById('status').textContent === 'Stopped.'")
        deadline = time.monotonic() + 10
        while httpx.get(server["url"] + "/health").json()["requests_in_flight"]:
            assert time.monotonic() < deadline, "the stopped request still holds its slot"
            time.sleep(0.05)
    assert (tmp_path / "web-chat.png").stat().st_size > 10_000
    page.close()
