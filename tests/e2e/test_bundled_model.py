"""The real bundled SmolLM2-135M-Instruct: convert once from GGUF, reload plainly, chat."""

from __future__ import annotations

import json
import time

import pytest
import torch

from keel.infer.generate import generate_reply
from keel.models.adapters import load_for_inference
from keel.models.bundled import MARKER_FILE, resolve_model_path

pytestmark = pytest.mark.slow
MODEL = "bundled:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cache_dir(bundled_cache_dir):
    """The session's cache, where conftest converted the bundled model (about 30 s)."""
    return bundled_cache_dir


@pytest.fixture(scope="module")
def converted(cache_dir):
    return resolve_model_path(MODEL, cache_dir, log=lambda s: None)


def test_conversion_verified(converted, cache_dir):
    assert converted == cache_dir / "models" / "smollm2-135m-instruct"
    marker = json.loads((converted / MARKER_FILE).read_text())
    assert marker["max_abs_diff"] < 1e-4
    assert (
        marker["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and marker["source_size"] > 0
    )
    assert [p.name for p in cache_dir.joinpath("models").iterdir()] == [converted.name]


def test_loads_with_plain_transformers(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert getattr(model, "hf_quantizer", None) is None and not getattr(
        model, "is_quantized", False
    )
    assert getattr(model.config, "quantization_config", None) is None
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (49152, 30, 576)
    assert cfg.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert "SmolLM" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


def test_generate_who_are_you(converted, cache_dir):
    model, tokenizer = load_for_inference(MODEL, None, cache_dir=cache_dir, log=lambda s: None)
    pieces = []
    reply = generate_reply(
        model,
        tokenizer,
        [{"role": "user", "content": "Who are you?"}],
        max_new_tokens=32,
        stream=pieces.append,
    )
    assert reply.strip() and "".join(pieces) == reply
    assert "<|im_end|>" not in reply


def test_second_resolve_is_fast(converted, cache_dir):
    start = time.perf_counter()
    assert resolve_model_path(MODEL, cache_dir, log=lambda s: None) == converted
    assert time.perf_counter() - start < 1.0


def test_a_few_training_steps_on_the_real_model(converted, cache_dir, tmp_path):
    """LoRA SFT on the shipped identity data: 3 real steps, loss falls, adapter reloads."""
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from keel.config import load_config
    from keel.train.run import run_training

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "examples/identity_lora.yaml",
        [
            f"model.cache_dir={cache_dir}",
            f"output.dir={tmp_path / 'out'}",
            "train.max_steps=3",
            "train.precision=fp32",
            "data.cutoff_len=256",
            "train.micro_batch_size=2",
            "train.lr=2e-3",
        ],
    )
    result = run_training(cfg, base_dir=root, log=lambda s: None)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < result.losses[0]
    base = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "out")
    assert sum(p.numel() for n, p in reloaded.named_parameters() if "lora_" in n) > 0
