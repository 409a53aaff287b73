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


def test_the_plan_says_where_a_moe_s_parameters_are(tmp_path):
    """Qwen3-30B-A3B's config alone: 95% of its parameters are routed experts, which QLoRA
    keeps in model.dtype (its params column holds them at 2 bytes each), and the summary
    says so."""
    import yaml
    from transformers import AutoConfig

    from keel.config import load_config
    from keel.plan import DeviceSpec, plan_run, summary
    from keel.plan.devices import GIB
    from keel.precision import Precision

    AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "model")  # fmt: skip
    run = {
        "model": {"path": str(tmp_path / "model"), "dtype": "bfloat16"},
        "method": {"type": "qlora"},
        "data": {"datasets": ["never-read.json"], "cutoff_len": 1024},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    devices = DeviceSpec(kind="cuda", per_node=1, memory_bytes=80 * GIB)
    plan = plan_run(
        load_config(tmp_path / "run.yaml"), devices=devices, precision=Precision("bf16", "test")
    )
    routed = 48 * 3 * 128 * 768 * 2048
    assert f"48 layers of 128 experts (8 per token), {routed:,} parameters (95%)" in summary(plan)
    qlora = next(o for o in plan.options if o.method == "qlora")
    assert qlora.per_device.params >= 2 * routed
