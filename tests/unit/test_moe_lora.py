"""LoRA on a mixture of experts: the linear modules are adapted, the fused routed experts
are not (PEFT would wrap them as parameters, a path keel does not run), and saying so."""

import pytest
import torch

from keel.config.schema import LoraConfig, MethodConfig
from keel.errors import ModelError
from keel.models import apply_method


def tiny_moe(model_type: str = "qwen3_moe"):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_all_linear_adapts_attention_and_leaves_the_experts_to_full_training(model_type):
    lines = []
    model = apply_method(
        tiny_moe(model_type), MethodConfig(type="lora", lora=LoraConfig(r=4)), log=lines.append
    )
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    note = next(line for line in lines if "mixture of experts" in line)
    assert "experts.down_proj, experts.gate_up_proj" in note and "full or freeze" in note


@pytest.mark.parametrize(("model_type", "name"), [("qwen3_moe", "gate_proj"), ("mixtral", "w1")])
def test_targets_that_peft_reads_as_the_experts_are_refused(model_type, name):
    lora = LoraConfig(r=4, targets=["q_proj", name])
    with pytest.raises(ModelError, match=f"PEFT reads {name} as the routed experts"):
        apply_method(tiny_moe(model_type), MethodConfig(type="lora", lora=lora), log=print)
