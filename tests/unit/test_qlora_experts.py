"""QLoRA with method.qlora.quantize_experts: a mixture of experts' fused routed experts in
NF4, read back dequantised, recomputed in backward instead of kept, and planned so.

Process-count parity (FSDP2 == one process) is in tests/distributed/test_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from keel.config.schema import (
    DataConfig,
    LoraConfig,
    MethodConfig,
    ModelConfig,
    OutputConfig,
    QloraConfig,
    RunConfig,
)
from keel.data import collate
from keel.distributed.process_group import DistContext
from keel.precision import Precision
from keel.quant import layout
from keel.quant import nf4 as keel_nf4
from keel.train.model_setup import build_training_model

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
EXPERTS, WIDTH, HIDDEN = 4, 32, 64  # gate_up_proj [4, 64, 64], down_proj [4, 64, 32]
SAMPLES = [([5, 9, 14, 3, 22, 7, 8], [-100, -100, 3, 22, 7, 8, 2]), ([5, 11, 6], [-100, 6, 2])]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=WIDTH,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def quiet(_message):
    pass


def build(path, quantize_experts: bool = True):
    method = MethodConfig(
        type="qlora",
        lora=LoraConfig(r=4, alpha=8.0, dropout=0.0),
        qlora=QloraConfig(quantize_experts=quantize_experts),
    )
    cfg = RunConfig(
        model=ModelConfig(path=str(path)),
        method=method,
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(path / "out")),
    )
    built = build_training_model(cfg, path, DistContext(), Precision("fp32", "test"), quiet)
    return built.model, built.objective.train()


def nf4_rounded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as keel stores it in NF4 ([experts * out, in] rows), dequantised."""
    rows = weight.reshape(-1, weight.shape[-1])
    mean = keel_nf4.absmax_mean_of(rows.__getitem__, *rows.shape, torch.float32)
    with torch.no_grad():
        target = nf4_tensor.to_nf4(torch.ones_like(rows), 64, layout.scaler_block(*rows.shape))
    keel_nf4.fill_nf4(target, rows, mean)
    return target.get_original_weight().view(weight.shape)


def test_the_experts_are_stored_in_nf4_and_read_back_as_nf4_rounds_them(moe_dir):
    from transformers import AutoModelForCausalLM

    model, _ = build(moe_dir)
    stored = {n: p for n, p in model.named_parameters() if keel_nf4.is_nf4(p)}
    experts = [n for n in stored if ".parametrizations." in n]
    assert len(experts) == 2 * 2  # gate_up_proj and down_proj in each of 2 layers
    assert all(n.endswith((".gate_up_proj.original", ".down_proj.original")) for n in experts)
    original = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    for layer, ours in zip(original.model.layers, model.get_base_model().model.layers):
        for name in ("gate_up_proj", "down_proj"):
            want = getattr(layer.mlp.experts, name).detach()
            got = getattr(ours.mlp.experts, name)  # dequantised on reading
            assert got.shape == want.shape and torch.equal(got, nf4_rounded(want))
            assert not torch.equal(got, want)  # really quantised
            blocks, error = want.reshape(-1, 64), (got - want).reshape(-1, 64)
            assert (error.abs().amax(dim=1) <= 0.17 * blocks.abs().amax(dim=1)).all()


def saved_shapes_and_grads(objective, *, recompute: bool):
    """The shapes autograd keeps for backward in one forward, and the LoRA gradients."""
    experts = [m for m in objective.modules() if type(m).__name__.endswith("Qwen3MoeExperts")]
    assert len(experts) == 2
    if not recompute:  # negative control: the experts' own forward, not keel's wrapper
        for module in experts:
            module.forward = module.forward.args[0]
    rows = [{"input_ids": i, "targets": t, "position_ids": list(range(len(i)))} for i, t in SAMPLES]
    shapes = []

    def keep(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    objective.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = objective(collate(rows, pad_id=0, padding_free=True))
    (out.loss / out.count).backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    return shapes, grads


def test_backward_recomputes_the_experts_instead_of_keeping_their_weights(moe_dir):
    def weights(shapes):  # [experts, ...] tensors of gate_up_proj's and down_proj's size
        sizes = {EXPERTS * 2 * WIDTH * HIDDEN, EXPERTS * HIDDEN * WIDTH}
        return [s for s in shapes if len(s) == 3 and s[0] == EXPERTS and math.prod(s) in sizes]

    _, objective = build(moe_dir)
    shapes, grads = saved_shapes_and_grads(objective, recompute=True)
    assert weights(shapes) == []
    _, kept = build(moe_dir)
    kept_shapes, kept_grads = saved_shapes_and_grads(kept, recompute=False)
    assert len(weights(kept_shapes)) == 2 * 2  # without the recompute: both, per layer
    assert grads.keys() == kept_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, kept_grads[name], rtol=1e-5, atol=1e-7)


def test_a_dense_model_is_refused_at_preflight(tiny_model_dir, tmp_path):
    from keel.config import load_config
    from keel.train.preflight import check_model

    raw = {
        "model": {"path": str(tiny_model_dir)},
        "method": {"type": "qlora", "qlora": {"quantize_experts": True}},
        "data": {"datasets": ["d.json"]},
        "output": {"dir": str(tmp_path / "out")},
    }
    _, problems = check_model(
        load_config(None, [], base=raw), tiny_model_dir, attn="sdpa", precision=None
    )
    assert len(problems) == 1 and "LlamaForCausalLM has no fused routed experts" in problems[0]


def test_the_plan_holds_qwen3_30b_a3b_s_experts_in_nf4(tmp_path):
    import yaml
    from transformers import AutoConfig

    from keel.config import load_config
    from keel.plan import DeviceSpec, plan_run, summary
    from keel.plan.devices import GIB

    AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "model")  # fmt: skip
    devices = DeviceSpec(kind="cuda", per_node=1, memory_bytes=80 * GIB)
    routed = 48 * 3 * 128 * 768 * 2048
    plans = {}
    for quantized in (False, True):
        run = {
            "model": {"path": str(tmp_path / "model"), "dtype": "bfloat16"},
            "method": {"type": "qlora", "qlora": {"quantize_experts": quantized}},
            "data": {"datasets": ["never-read.json"], "cutoff_len": 1024},
            "train": {"precision": "bf16"},
            "output": {"dir": str(tmp_path / "out")},
        }
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
        plans[quantized] = plan_run(load_config(tmp_path / "run.yaml"), devices=devices)
    option = {q: next(o for o in p.options if o.method == "qlora") for q, p in plans.items()}
    saved = option[False].per_device.params - option[True].per_device.params
    # bf16 experts (2 bytes a value) become NF4 (~0.52): 1.48 bytes a value less
    assert saved == pytest.approx(1.48 * routed, rel=0.01)
    assert "qlora in NF4 (method.qlora.quantize_experts)" in summary(plans[True])
    assert "qlora in model.dtype" in summary(plans[False])
    # backward recomputes the experts: their matmuls' outputs are not kept per layer
    assert option[True].per_device.activations < option[False].per_device.activations
