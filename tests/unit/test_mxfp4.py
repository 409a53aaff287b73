"""gpt-oss checkpoints as they ship, routed experts in MXFP4: keel dequantizes them while
loading, exactly as transformers does, and trains and saves plain weights."""

from __future__ import annotations

import json

import pytest
import torch
from config_support import qa_rows, tiny_lora_config
from conftest import build_tiny_tokenizer
from moe_support import EXPERT_WEIGHTS, write_mxfp4_gpt_oss
from safetensors.torch import load_file

from keel.config import load_config
from keel.models.checkpoint_reader import CheckpointReader
from keel.models.materialize import build_empty_model, stored_key_lookup
from keel.train.run import run_training


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss with its experts as MXFP4 blocks and scales, as the Hub's checkpoints
    hold them ("mxfp4"), the same weights stored plainly ("plain"), and data."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt-oss")
    tokenizer = build_tiny_tokenizer()
    write_mxfp4_gpt_oss(root / "mxfp4", tokenizer)
    # the same weights as plain tensors, through transformers' own dequantization
    from transformers import Mxfp4Config

    plain = AutoModelForCausalLM.from_pretrained(
        root / "mxfp4", dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    vars(plain.config).pop("quantization_config", None)  # plain weights now
    plain.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    (root / "qa.json").write_text(json.dumps(qa_rows(8)))
    return root


def test_keel_reads_mxfp4_experts_as_transformers_dequantizes_them(gpt_oss):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_file(gpt_oss / "mxfp4" / "model.safetensors")
    model = build_empty_model(gpt_oss / "mxfp4", dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None  # saved plain after
    reader = CheckpointReader(gpt_oss / "mxfp4")
    key_of = stored_key_lookup(model, reader)
    names = [n for n, _ in model.named_parameters() if n.endswith(EXPERT_WEIGHTS)]
    assert len(names) == 4
    for name in names:
        want = convert_moe_packed_tensors(
            stored[name + "_blocks"], stored[name + "_scales"], dtype=torch.float32
        )
        got = reader.get(key_of(name))
        assert got.shape == dict(model.named_parameters())[name].shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        rows = (slice(1, 3), *(slice(0, n) for n in got.shape[1:]))  # a process's experts
        torch.testing.assert_close(reader.get(key_of(name), rows), want[1:3], rtol=0, atol=0)
    reader.close()


def test_a_run_from_mxfp4_trains_as_from_the_plain_weights(gpt_oss, tmp_path):
    losses = {}
    for source in ("mxfp4", "plain"):
        out = tmp_path / source
        raw = tiny_lora_config(gpt_oss / source, gpt_oss / "qa.json", out)
        raw["method"] = {"type": "full"}
        losses[source] = run_training(load_config(None, [], base=raw), log=lambda _m: None).losses
    assert losses["mxfp4"] == losses["plain"]  # the same weights, bit for bit
    saved = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    assert "quantization_config" not in saved  # plain weights, said so
    keys = load_file(tmp_path / "mxfp4" / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert not [k for k in keys if k.endswith(("_blocks", "_scales"))]
