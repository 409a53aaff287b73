"""A tiny gpt-oss whose checkpoint holds its routed experts in MXFP4 (blocks and scales),
as gpt-oss checkpoints on the Hub do: for the loading tests and the process-count parity."""

from __future__ import annotations

import json
from pathlib import Path

import torch

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def write_mxfp4_gpt_oss(out: Path, tokenizer, seed: int = 0) -> Path:
    """Save a random 2-layer gpt-oss (4 experts, 2 per token) at `out`, then replace its
    expert weights with random MXFP4 blocks and scales and say so in config.json."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(EXPERT_WEIGHTS)]:
        experts, inputs, outputs = tensors.pop(key).shape
        groups = (experts, outputs, inputs // 32)
        tensors[key + "_blocks"] = torch.randint(
            0, 256, (*groups, 16), dtype=torch.uint8, generator=generator
        )
        tensors[key + "_scales"] = torch.randint(
            120, 128, groups, dtype=torch.uint8, generator=generator
        )
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((out / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(saved))
    return out
