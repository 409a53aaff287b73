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


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_target_parameters_adapt_the_fused_experts(model_type):
    lines = []
    base = tiny_moe(model_type)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        before = base(ids).logits
    lora = LoraConfig(r=4, dropout=0.0, target_parameters=EXPERTS)
    model = apply_method(base, MethodConfig(type="lora", lora=lora), log=lines.append)
    wrapped = {
        f"{n.replace('.base_layer', '')}.{m.parameter_name}"
        for n, m in model.named_modules()
        if type(m).__name__ == "ParamWrapper"
    }
    assert len(wrapped) == 4  # 2 layers x gate_up_proj and down_proj
    assert {".".join(w.split(".")[-2:]) for w in wrapped} == set(EXPERTS)
    assert any(
        "LoRA r=4" in line and "experts.down_proj, experts.gate_up_proj" in line for line in lines
    )
    assert not any("mixture of experts" in line for line in lines)  # no "not the experts"
    with torch.no_grad():  # B starts at zero: the base model exactly
        torch.testing.assert_close(model(ids).logits, before)
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "experts" in n and ".lora_B." in n}
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_target_parameters_that_cannot_adapt_are_refused():
    from conftest import build_tiny_model

    from keel.config import load_config
    from keel.errors import ConfigError
    from keel.models.adapters import method_problems

    method = MethodConfig(type="lora", lora=LoraConfig(dropout=0.0, target_parameters=EXPERTS))
    (dense,) = method_problems(build_tiny_model(64), method)
    assert "has no fused routed experts" in dense
    wrong = MethodConfig(
        type="lora", lora=LoraConfig(dropout=0.0, target_parameters=["experts.w9"])
    )
    (unknown,) = method_problems(tiny_moe(), wrong)
    assert "experts.w9" in unknown and "experts.down_proj, experts.gate_up_proj" in unknown
    raw = {"model": {"path": "m"}, "data": {"datasets": ["d.json"]}, "output": {"dir": "o"}}
    experts = f"method.lora.target_parameters=[{', '.join(EXPERTS)}]"
    for extra, why in [
        (("method.lora.dropout=0.05",), "set dropout 0"),
        (("method.lora.dropout=0", "method.lora.dora=true"), "DoRA adapts linear modules"),
        (
            ("method.lora.dropout=0", "method.type=qlora", "method.qlora.quantize_experts=true"),
            "drop one of them",
        ),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(None, [experts, *extra], base=raw)


def test_keel_serve_names_why_an_experts_adapter_cannot_share_a_batch(tmp_path):
    import json

    from keel.infer.serve.adapter_files import AdapterCaps, inspect_adapter

    folder = tmp_path / "adapter"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_parameters": EXPERTS}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="serve it alone"):
        inspect_adapter("moe", str(folder), AdapterCaps())


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE with the tiny tokenizer, and QA data, on disk."""
    import json

    from conftest import QA, build_tiny_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe-lora")
    AutoModelForCausalLM.from_config(config).save_pretrained(path / "model")
    tokenizer.save_pretrained(path / "model")
    rows = [{"instruction": q, "input": "", "output": a} for q, a in QA]
    (path / "qa.json").write_text(json.dumps(rows))
    return path


def test_a_run_with_lora_on_the_experts_resumes_exactly_and_merges(moe_dir, tmp_path):
    from config_support import tiny_lora_config
    from safetensors import safe_open

    from keel.config import load_config
    from keel.train.run import run_training

    class Crash(Exception):
        pass

    def run(out, on_step_end=None):
        raw = tiny_lora_config(
            moe_dir / "model",
            moe_dir / "qa.json",
            out,
            output={"save_every": 2, "merge_lora": True},
        )
        raw["train"]["max_steps"] = 4
        raw["method"]["lora"]["target_parameters"] = EXPERTS
        return run_training(
            load_config(None, [], base=raw), log=lambda _m: None, on_step_end=on_step_end
        )

    whole = run(tmp_path / "whole")

    def crash_at_3(step, _record):
        if step == 3:
            raise Crash()

    with pytest.raises(Crash):
        run(tmp_path / "resumed", crash_at_3)
    resumed = run(tmp_path / "resumed")
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-6, abs=1e-7)
    with safe_open(tmp_path / "whole/adapter_model.safetensors", "pt") as adapter:
        trained = {k: adapter.get_tensor(k) for k in adapter.keys() if ".experts." in k}  # noqa: SIM118
    assert len(trained) == 8  # 2 layers x 2 weights x (A, B)
    assert all(t.abs().sum() > 0 for k, t in trained.items() if "lora_B" in k)  # B moved from 0
    with (
        safe_open(tmp_path / "whole/merged/model.safetensors", "pt") as merged,
        safe_open(moe_dir / "model/model.safetensors", "pt") as base,
    ):
        key = "model.layers.0.mlp.experts.0.down_proj.weight"
        keys = set(merged.keys())  # noqa: SIM118
        assert key in keys  # saved one tensor per expert, as MoE checkpoints are
        assert not torch.equal(merged.get_tensor(key), base.get_tensor(key))
