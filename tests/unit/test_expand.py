"""keel expand (LLaMA Pro's block expansion) and method.freeze.expanded_blocks: the expanded
model computes what the original does, and training its new blocks trains only those."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from keel.errors import ModelError
from keel.export.expand import ExpandRequest, expand_model
from keel.models.loading import load_model

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])


def _model_dir(path, layers: int = 4, model=None):
    tokenizer = build_tiny_tokenizer()
    (model or build_tiny_model(len(tokenizer), layers=layers)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _logits(folder) -> torch.Tensor:
    with torch.no_grad():
        return load_model(folder, dtype=torch.float32)(IDS).logits


def test_an_expanded_model_computes_what_the_original_does(tmp_path):
    """4 layers + 2 blocks: a copy of layers 1 and 3 (new indices 2 and 5) with o_proj and
    down_proj zero; the other layers as they were; the same logits, also with a KV cache."""
    original = _model_dir(tmp_path / "four")
    out = expand_model(ExpandRequest(model=str(original), blocks=2, out=tmp_path / "pro"),
                       log=lambda _m: None)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 6
    assert json.loads((out / "keel_expand.json").read_text())["inserted_layers"] == [2, 5]
    torch.testing.assert_close(_logits(out), _logits(original), rtol=0, atol=1e-6)
    old = dict(load_model(original, dtype=torch.float32).named_parameters())
    new = dict(load_model(out, dtype=torch.float32).named_parameters())
    moved = {0: 0, 1: 1, 2: 1, 3: 2, 4: 3, 5: 3}  # new index -> the layer it copies
    for name, param in new.items():
        if ".layers." not in name:
            torch.testing.assert_close(param, old[name])
            continue
        index = int(name.split(".")[2])
        source = old[name.replace(f".layers.{index}.", f".layers.{moved[index]}.")]
        if index in (2, 5) and ("o_proj" in name or "down_proj" in name):
            assert param.abs().max() == 0, name
        else:
            torch.testing.assert_close(param, source, msg=name)
    # incremental decoding: each block keeps its own slot of the KV cache
    torch.testing.assert_close(_next_logits(out), _next_logits(original), rtol=0, atol=1e-5)


def _next_logits(folder) -> torch.Tensor:
    """The logits of 3 tokens decoded one at a time after IDS, through the KV cache."""
    model = load_model(folder, dtype=torch.float32)
    with torch.no_grad():
        step = model(IDS, use_cache=True)
        cache, logits = step.past_key_values, []
        for token in (11, 12, 13):
            step = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            logits.append(step.logits[0, -1])
    return torch.stack(logits)


def test_expansion_refuses_what_it_cannot_write(tmp_path):
    original = _model_dir(tmp_path / "four")
    with pytest.raises(ModelError, match="4 decoder layers must split into that many"):
        expand_model(ExpandRequest(model=str(original), blocks=3, out=tmp_path / "x"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="is not empty; keel never overwrites it"):
        expand_model(ExpandRequest(model=str(original), blocks=2, out=tmp_path / "full"))
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_per_layer_settings_follow_their_layers(tmp_path):
    """A Qwen3 with sliding and full attention layers: each new block gets its source
    layer's type, so every old layer keeps its own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    config = AutoConfig.for_model(
        "qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=types, sliding_window=4, use_sliding_window=True, max_window_layers=4,
    )  # fmt: skip
    torch.manual_seed(0)
    original = _model_dir(tmp_path / "qwen3", model=AutoModelForCausalLM.from_config(config))
    out = expand_model(ExpandRequest(model=str(original), blocks=2, out=tmp_path / "pro"),
                       log=lambda _m: None)  # fmt: skip
    saved = json.loads((out / "config.json").read_text())
    assert saved["layer_types"] == [types[0], types[1], types[1], types[2], types[3], types[3]]
    assert saved["max_window_layers"] == 6  # every layer before, every layer after
    torch.testing.assert_close(_logits(out), _logits(original), rtol=0, atol=1e-6)


def test_training_the_expanded_blocks_trains_only_them(tmp_path, data_file):
    """The LLaMA Pro recipe: expand, then freeze with expanded_blocks; one step changes the
    new blocks' weights and no other."""
    from test_train_run import config

    from keel.train.run import run_training

    original = _model_dir(tmp_path / "four")
    pro = expand_model(ExpandRequest(model=str(original), blocks=2, out=tmp_path / "pro"),
                       log=lambda _m: None)  # fmt: skip
    out = tmp_path / "trained"
    overrides = ("method.freeze.trainable_layers=2", "method.freeze.expanded_blocks=true",
                 "train.max_steps=2", "data.val_size=0")  # fmt: skip
    lines: list[str] = []
    run_training(config(pro, data_file, out, *overrides, method="freeze"), log=lines.append)
    assert any("decoder layers 2, 5 of 6" in line for line in lines)
    before = dict(load_model(pro, dtype=torch.float32).named_parameters())
    after = dict(load_model(out, dtype=torch.float32).named_parameters())
    changed = {name.split(".")[2] for name in before if not torch.equal(before[name], after[name])}
    assert changed == {"2", "5"}
