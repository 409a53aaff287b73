"""`keel serve` as users start it: a real process on a free port, answering, stopping on Ctrl-C.
Refused flags are checked through keel.cli.main in the test process (no server starts, and an
interpreter start per command would cost more than the check)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from cli_support import keel_in_process
from serve_support import varied_tiny_model, write_model_dir


@pytest.fixture
def model_dir(tiny_tokenizer, tmp_path):
    return write_model_dir(varied_tiny_model(len(tiny_tokenizer)), tiny_tokenizer, tmp_path / "m")


def test_serve_process_answers_and_stops_on_interrupt(model_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "keel", "serve", "--model", str(model_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stdout:  # the startup line names the address
            if found := re.search(r"on (http://127\.0\.0\.1:\d+)/", line):
                url = found.group(1)
                break
        else:
            pytest.fail(f"keel serve printed no address; stderr:\n{process.stderr.read()}")
        body = {"model": str(model_dir), "messages": [{"role": "user", "content": "hi"}]}
        # greedy: a sampled reply from a random model may draw the end token early, which
        # made this count flaky; greedy it is fixed (and this model's greedy reply is longer)
        request = {**body, "max_tokens": 5, "temperature": 0}
        # httpx's default 5 s is too short for a first answer on a loaded 2-core machine
        reply = httpx.post(url + "/v1/chat/completions", json=request, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 5
        assert reply["choices"][0]["finish_reason"] == "length"
        assert httpx.get(url + "/", timeout=120).status_code == 200
    finally:
        os.kill(process.pid, signal.SIGINT)
        returncode = process.wait(timeout=60)
    assert returncode == 0, process.stderr.read()


def test_vllm_backend_is_refused_without_vllm_or_gpu(model_dir):
    result = keel_in_process("serve", "--model", str(model_dir), "--backend", "vllm")
    assert result.returncode == 2
    assert "--backend vllm" in result.stderr and "Traceback" not in result.stderr
    assert "vLLM is not installed" in result.stderr or "CUDA GPU" in result.stderr


def test_bad_flags_are_reported_together(model_dir):
    result = keel_in_process(
        "serve", "--model", str(model_dir), "--adapter", "nopath", "--max-batch-size", "0"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--adapter nopath: write it as NAME=PATH" in result.stderr
    assert "--max-batch-size 0: must be at least 1" in result.stderr
