"""keel.models.loading: dtype names, tokenizer pad fallback, model loading."""

from __future__ import annotations

import pytest
import torch

from keel.errors import ModelError
from keel.models.loading import load_model, load_tokenizer, torch_dtype


def test_torch_dtype_names():
    assert torch_dtype("float32") is torch.float32
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float16") is torch.float16
    assert torch_dtype("auto") is None
    with pytest.raises(ModelError, match="float32"):
        torch_dtype("fp8")


def test_load_tokenizer_falls_back_to_eos_for_pad(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer.__class__(
        tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|im_end|>"
    )
    assert tok.pad_token is None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<|im_end|>"


def test_load_tokenizer_keeps_existing_pad(tiny_model_dir):
    assert load_tokenizer(tiny_model_dir).pad_token == "<|endoftext|>"


def test_load_model_dtype_and_absolute_name(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tiny_model_dir.parent)
    model = load_model(tiny_model_dir.name, dtype=torch.bfloat16)  # a relative path
    assert next(model.parameters()).dtype is torch.bfloat16
    # PEFT copies name_or_path into adapter_config.json; it must work from any directory.
    assert model.name_or_path == str(tiny_model_dir.resolve())


def test_load_model_missing_weights_is_model_error(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelError, match=str(tmp_path)):
        load_model(tmp_path, dtype=torch.float32)


def test_the_tokenizer_is_hugging_faces_whatever_is_installed(tiny_model_dir, monkeypatch):
    """With mistral-common installed, transformers picks its backend for a repo with
    tekken.json (no chat template: the run would fall back to chatml); keel asks for the
    Hugging Face tokenizer on every machine."""
    from transformers import AutoTokenizer

    seen = {}
    real = AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    load_tokenizer(tiny_model_dir)
    assert seen.get("mistral_format") is False


def test_a_repo_with_tekken_json_loads_its_hugging_face_tokenizer(tmp_path):
    """Where mistral-common is installed: a Mistral repo as they ship, tekken.json beside
    tokenizer.json and a chat template; transformers alone picks MistralCommonBackend (no
    chat template), keel the Hugging Face tokenizer with the repo's template."""
    mistral_common = pytest.importorskip("mistral_common")
    import shutil
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    shutil.copy(
        Path(mistral_common.__file__).parent / "data" / "tekken_240911.json",
        tmp_path / "tekken.json",
    )
    AutoConfig.for_model("mistral", vocab_size=131072).save_pretrained(tmp_path)
    converted = AutoTokenizer.from_pretrained(tmp_path, mistral_format=False)
    converted.eos_token, converted.bos_token = "</s>", "<s>"
    converted.chat_template = TEMPLATE
    converted.save_pretrained(tmp_path)
    assert type(AutoTokenizer.from_pretrained(tmp_path)).__name__ == "MistralCommonBackend"
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.convert_tokens_to_ids("[INST]") == 3  # tekken's control token


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}"
    "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
