"""`keel plan` with QLoRA's NF4 base weights and with offloaded activation checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from test_plan import SMALL, config_only_dir, run_yaml
from torch import nn

from keel.cli import main
from keel.config import load_config
from keel.config.schema import MethodConfig
from keel.plan import DeviceSpec, plan_run
from keel.plan.architecture import build_meta_model, read_architecture
from keel.plan.devices import GIB
from keel.quant.layout import nf4_bytes, quantizable

# head_dim 10: k/v_proj are 20 x 40 (800 values, not whole 64-value blocks), so they stay
# in the compute dtype; q_proj's 25 blocks do not split over 2 processes.
ODD = {**SMALL, "hidden_size": 40, "intermediate_size": 96, "num_attention_heads": 4}
ODD["num_key_value_heads"] = 2


def expected_params(cfg, *, world: int, sharded: bool, compute: int) -> int:
    """Bytes one process holds, counted here from the meta model with LoRA applied: the
    frozen nn.Linear weights of the decoder layers at NF4 bytes where they split into NF4
    blocks (else in the compute dtype), everything else (adapters, embeddings, norms,
    buffers) at its dtype; FSDP2 shards padded to ceil(rows / world) rows."""
    from keel.models import apply_method

    model = build_meta_model(read_architecture(cfg), dtype=torch.float32)
    with torch.device("meta"):
        model = apply_method(model, MethodConfig(type="lora"), log=lambda _m: None)
    layers = model.get_base_model().model.layers
    frozen = {
        id(m.weight)
        for m in layers.modules()
        if type(m) is nn.Linear and not m.weight.requires_grad
    }
    assert frozen and not any(id(p) in frozen for p in model.get_base_model().lm_head.parameters())
    nf4_world = world if sharded else 1
    total = 0
    for p in [*model.parameters(), *model.buffers()]:
        rows = p.shape[0] if p.dim() else 1
        rest = math.prod(p.shape[1:])
        if id(p) in frozen and quantizable(rows, rest, nf4_world):
            total += nf4_bytes(rows, rest, compute, nf4_world)
            continue
        itemsize = compute if id(p) in frozen else p.element_size()
        if sharded and p.dim() and isinstance(p, nn.Parameter):
            rows = -(-rows // world)
        total += rows * rest * itemsize
    return total


@pytest.mark.parametrize("arch", [SMALL, ODD], ids=["small", "odd"])
@pytest.mark.parametrize("precision,compute", [("bf16", 2), ("fp32", 4)])
def test_qlora_params_are_exactly_nf4_bytes_plus_the_rest(tmp_path, arch, precision, compute):
    model_dir = config_only_dir(tmp_path, "m", arch)
    cfg = load_config(run_yaml(tmp_path, model_dir, method="qlora", precision=precision))
    for world in (1, 2):
        devices = DeviceSpec(kind="cuda", per_node=world, memory_bytes=80 * GIB)
        plan = plan_run(cfg, devices=devices)
        strategies = ("single",) if world == 1 else ("ddp", "fsdp")
        for strategy in strategies:
            sharded = strategy == "fsdp"
            got = plan.option_for(strategy, "qlora", False).per_device.params
            want = expected_params(cfg, world=world, sharded=sharded, compute=compute)
            assert got == want, (world, strategy)
            lora = plan.option_for(strategy, "lora", False).per_device.params
            # ODD on 2 FSDP ranks has no weight that splits into NF4 blocks
            assert got < lora if arch is SMALL or world == 1 or not sharded else got <= lora


def test_qlora_compute_dtype_setting_overrides_the_precision(tmp_path):
    model_dir = config_only_dir(tmp_path, "m", SMALL)
    cfg = load_config(
        run_yaml(tmp_path, model_dir, method="qlora", precision="bf16"),
        ["method.qlora.compute_dtype=float32"],
    )
    plan = plan_run(cfg, devices=DeviceSpec(kind="cuda", per_node=1, memory_bytes=80 * GIB))
    got = plan.option_for("single", "qlora", False).per_device.params
    assert got == expected_params(cfg, world=1, sharded=False, compute=4)


def _offload_pair(tmp_path, kind: str):
    model_dir = config_only_dir(tmp_path, "m", SMALL)
    yaml = run_yaml(tmp_path, model_dir, method="lora", precision="bf16", micro_batch_size=2)
    cfg = load_config(yaml, ["train.gradient_checkpointing=offload"])
    plan = plan_run(cfg, devices=DeviceSpec(kind=kind, per_node=1, memory_bytes=80 * GIB))
    assert plan.checkpointing == "offload"
    return (
        plan,
        plan.option_for("single", "lora", True),
        plan.option_for("single", "lora", "offload"),
    )


def test_offload_moves_the_layer_inputs_to_host_memory_on_a_gpu(tmp_path):
    plan, on, off = _offload_pair(tmp_path, "cuda")
    layers, tokens = 4, 2 * 2048
    one_input = tokens * 4 * 256  # fp32 residual stream (fp32 master weights), hidden 256
    # Device: every layer's input leaves, the recomputed layer's comes back for backward
    assert on.per_device.activations - off.per_device.activations == (layers - 1) * one_input
    assert on.per_device.total > off.per_device.total
    # Host: one pinned block per layer, rounded to a power of two by the pinned allocator
    assert off.host_bytes - on.host_bytes == layers * 2 ** math.ceil(math.log2(one_input))
    from keel.plan import decide
    from keel.plan.report import describe, table

    decision = decide(plan)
    assert decision.option.gradient_checkpointing == "offload"
    assert "offloaded checkpointing" in describe(decision.option)
    assert any(line.split()[2] == "offload" for line in table(plan).splitlines()[1:])


def test_offload_is_plain_checkpointing_on_a_cpu(tmp_path):
    _plan, on, off = _offload_pair(tmp_path, "cpu")
    assert off.per_device == on.per_device and off.host_bytes == on.host_bytes


def test_offload_is_weighed_on_gpus_and_suggested_last(tmp_path):
    model_dir = config_only_dir(tmp_path, "m", SMALL)
    cfg = load_config(run_yaml(tmp_path, model_dir, method="lora"))
    gpu = plan_run(cfg, devices=DeviceSpec(kind="cuda", per_node=1, memory_bytes=80 * GIB))
    assert gpu.option_for("single", "lora", "offload") is not None
    assert gpu.recommendation.gradient_checkpointing is False  # it fits without
    cpu = plan_run(cfg, devices=DeviceSpec(kind="cpu", per_node=1, memory_bytes=80 * GIB))
    assert cpu.option_for("single", "lora", "offload") is None


def test_keel_plan_prints_qlora_and_nf4(tmp_path, capsys):
    model_dir = config_only_dir(tmp_path, "m", SMALL)
    yaml = run_yaml(tmp_path, model_dir, method="qlora")
    assert main(["plan", str(yaml), "--gpu-memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    # 4 layers x 7 frozen linears (LoRA's base layers and the untargeted ones)
    assert "trainable with qlora, 28 frozen linear weights in NF4" in out
    assert out.splitlines()[-1].startswith("recommendation: single + qlora")
