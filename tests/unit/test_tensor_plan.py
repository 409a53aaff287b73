"""Tensor parallelism before anything loads: which modules split and how (transformers'
plan for the model), the models and settings keel refuses to split and why, the (dp, tp)
mesh and the layouts it gives the weights (torch's fake backend standing in for 4 and 8
ranks: building meshes and splitting on the meta device send nothing), and what the
memory planner counts per process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from config_support import run_config_with
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from keel.config.schema import RunConfig
from keel.config.validate import check_config
from keel.distributed.parallel_dims import ParallelDims
from keel.distributed.parallelize import ParallelizeSettings, fsdp_units, parallelize
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy, configured_strategy
from keel.distributed.tensor_parallel import partial_parameters
from keel.errors import KeelError
from keel.models.tensor_plan import one_process_part, split_problems, tensor_plan


def _meta(model_type: str, **sizes) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    config = AutoConfig.for_model(model_type, **(shape | sizes))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


LLAMA_STYLES = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def test_the_plan_is_transformers_own_for_the_model():
    plan, problem = tensor_plan(_meta("llama"), 2)
    assert problem is None and plan.styles == LLAMA_STYLES and plan.partial == ()
    qwen3, _ = tensor_plan(_meta("qwen3", head_dim=4), 2)
    assert qwen3.styles == LLAMA_STYLES  # and the per-head norms, whole with summed grads
    assert qwen3.partial == ("self_attn.q_norm", "self_attn.k_norm")


@pytest.mark.parametrize(
    ("model", "size", "fragment"),
    [
        (lambda: _meta("llama"), 3, "num_attention_heads 4, which does not split over 3"),
        (lambda: _meta("llama", num_attention_heads=8, num_key_value_heads=2), 4,
         "num_key_value_heads 2"),
        (lambda: _meta("qwen3_moe", head_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=8), 2, "e.g. a mixture of experts"),
        (lambda: _meta("gpt2", n_embd=16, n_layer=2, n_head=4), 2,
         "transformers has no tensor-parallel plan for GPT2LMHeadModel"),
    ],
)  # fmt: skip
def test_models_keel_cannot_split_are_refused_before_loading(model, size, fragment):
    plan, problem = tensor_plan(model(), size)
    assert plan is None and fragment in problem and f"tensor_parallel = {size}" in problem


def test_a_plan_that_names_no_module_of_the_layers_is_refused():
    """A plan whose modules the layers do not have would split nothing: each process of a
    group would compute the whole model, silently."""
    model = _meta("llama")
    model.config.base_model_tp_plan = {"layers.*.attn.c_attn": "colwise"}
    plan, problem = tensor_plan(model, 2)
    assert plan is None and "none of the modules transformers' plan" in problem


def test_a_vision_language_model_splits_its_language_model_only():
    from vlm_support import build_tiny_qwen2_vl

    with torch.device("meta"):
        model = build_tiny_qwen2_vl()
    cfg = _config()
    assert split_problems(model, cfg.distributed) == []
    plan, _ = tensor_plan(model, 2)  # its text config's plan, on the language model's layers
    assert plan.styles == LLAMA_STYLES
    heads = model.config.get_text_config().num_attention_heads
    (problem,) = split_problems(
        model, _config(**{"distributed.tensor_parallel": heads + 1}).distributed
    )
    assert f"num_attention_heads {heads}" in problem
    cfg.distributed.tensor_parallel = 1
    assert split_problems(_meta("llama"), cfg.distributed) == []


def _config(**settings) -> RunConfig:
    return run_config_with(Path("unused"), {"distributed.tensor_parallel": 2, **settings})


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({}, None),
        ({"method.type": "full"}, None),
        ({"train.stage": "dpo"}, None),
        ({"distributed.fsdp.shard_size": 2}, None),  # HSDP over the groups
        ({"distributed.strategy": "ddp"}, "runs under FSDP2"),
        ({"distributed.context_parallel": 2}, "not both"),
        ({"method.type": "qlora"}, "use method.type lora"),
        ({"method.type": "oft"}, "OFT's rotations are not split"),
        ({"method.lora.dora": True}, "DoRA's magnitudes"),
        ({"method.lora.init": "pissa"}, "the decomposition needs each whole weight"),
        ({"method.type": "full", "method.qat.scheme": "int4"}, "fake-quantised layers"),
        ({"train.stage": "grpo"}, None),  # the group generates together
        ({"distributed.tensor_parallel": 0}, "must be a whole number of processes"),
    ],
)
def test_settings_tensor_parallelism_cannot_run_with_are_refused(settings, problem):
    found = [p for p in check_config(_config(**settings)) if "tensor_parallel" in p]
    assert (found == []) if problem is None else any(problem in p for p in found), found


def test_tensor_parallelism_runs_under_fsdp_even_with_one_group():
    one_group = configured_strategy(
        "auto", cpu_offload=False, dp_size=1, cuda=False, tensor_parallel=2
    )
    assert one_group is Strategy.FSDP
    offloaded = configured_strategy(
        "fsdp", cpu_offload=True, dp_size=2, cuda=True, tensor_parallel=2
    )
    assert offloaded is Strategy.FSDP_OFFLOAD
    assert configured_strategy("auto", cpu_offload=False, dp_size=1, cuda=False) is Strategy.SINGLE


@pytest.fixture
def fake_ranks(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    rank, world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield rank, world
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_ranks", [(3, 4)], indirect=True)
def test_groups_of_consecutive_processes_split_the_layers(fake_ranks):
    """Rank 3 of 4 in groups of 2: group 1 reads data-parallel share 1; the world's mesh is
    (dp 2, tp 2); FSDP2 shards over dp, and gradients average over dp only."""
    dims = ParallelDims.for_strategy(Strategy.DDP, 4).build_mesh("cpu").with_tensor(2, "cpu")
    sharded = dims.with_strategy(Strategy.FSDP)
    assert (sharded.dp_shard, sharded.tp, sharded.dp_size, sharded.grad_size) == (2, 2, 2, 2)
    assert sharded.mesh.mesh_dim_names == ("dp", "tp")
    assert [sharded.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [sharded.tp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    ctx = DistContext(rank=3, world_size=4, dims=sharded)
    assert (ctx.dp_rank, ctx.tp_rank, ctx.tp_size, ctx.leads_group) == (1, 1, 2, False)
    assert sharded.tp_mesh().size() == 2 and sharded.dp_mesh().size() == 2
    with pytest.raises(KeelError, match="does not divide the 4 processes"):
        ParallelDims.for_strategy(Strategy.DDP, 4).build_mesh("cpu").with_tensor(3, "cpu")


def _lm(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _split(model: nn.Module, dims: ParallelDims):
    """Split and shard `model` as keel's model set-up does (on the meta device)."""
    lm = _lm(model)
    plan, _ = tensor_plan(lm, 2)
    units = fsdp_units(lm, lm.model.layers, embeddings=True)
    parallelize(model, dims, ParallelizeSettings(strategy=Strategy.FSDP, units=units, tensor=plan))
    return plan


@pytest.mark.parametrize("fake_ranks", [(1, 4)], indirect=True)
def test_a_lora_layer_splits_with_its_base(fake_ranks):
    """Colwise q_proj: its base and lora_B split their outputs (rows), lora_A stays whole;
    rowwise o_proj: its base and lora_A split their inputs (columns), lora_B stays whole.
    Then FSDP2 shards every tensor's rows over dp; the per-head norms are whole."""
    from peft import LoraConfig, get_peft_model

    dims = ParallelDims.for_strategy(Strategy.DDP, 4).build_mesh("cpu").with_tensor(2, "cpu")
    dims = dims.with_strategy(Strategy.FSDP)
    with torch.device("meta"):
        model = get_peft_model(
            _meta("qwen3", head_dim=4), LoraConfig(r=4, target_modules="all-linear")
        )
    plan = _split(model, dims)
    attention = _lm(model).model.layers[0].self_attn

    def placements(tensor):
        assert isinstance(tensor, DTensor)
        return tensor.device_mesh.mesh_dim_names, tensor.placements

    split_rows = (("dp", "tp"), (Shard(0), Shard(0)))
    assert placements(attention.q_proj.base_layer.weight)[0] == split_rows[0]
    assert placements(attention.q_proj.base_layer.weight)[1][1] == Shard(0)
    assert placements(attention.q_proj.lora_B["default"].weight)[1][1] == Shard(0)
    assert placements(attention.q_proj.lora_A["default"].weight) == (("dp",), (Shard(0),))
    assert placements(attention.o_proj.base_layer.weight)[1][1] == Shard(1)
    assert placements(attention.o_proj.lora_A["default"].weight)[1][1] == Shard(1)
    assert placements(attention.o_proj.lora_B["default"].weight) == (("dp",), (Shard(0),))
    assert placements(attention.q_norm.weight) == (("dp",), (Shard(0),))
    assert attention.q_proj.base_layer.weight.to_local().shape == (4, 16)  # 16 rows / tp / dp
    # LoRA freezes the norms: nothing to sum; full fine-tuning trains them
    assert partial_parameters(_lm(model).model.layers, plan) == []


@pytest.mark.parametrize("fake_ranks", [(3, 8)], indirect=True)
def test_hsdp_and_tensor_parallelism_make_a_three_axis_mesh(fake_ranks):
    """8 processes, tp 2, shard_size 2: 2 copies, each sharded over 2 groups of 2."""
    dims = ParallelDims.for_strategy(Strategy.DDP, 8).build_mesh("cpu").with_tensor(2, "cpu")
    dims = dims.with_strategy(Strategy.FSDP, 2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.hybrid) == (2, 2, 2, True)
    model = _meta("llama")
    _split(model, dims)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert weight.placements[0] == Replicate() and weight.placements[2] == Shard(0)


def test_one_process_part_is_what_the_planner_counts():
    model = _meta("llama")
    plan, _ = tensor_plan(model, 2)
    one_process_part(model, plan, 2)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.shape == (8, 16)  # 16 rows over 2
    assert layer.self_attn.o_proj.weight.shape == (16, 8)  # 16 columns over 2
    assert layer.mlp.down_proj.weight.shape == (16, 16)
    assert layer.mlp.down_proj.in_features == 16 and layer.mlp.up_proj.out_features == 16
    assert model.model.embed_tokens.weight.shape == (64, 16)  # whole


def test_the_plan_counts_one_process_part_of_each_layer(tmp_path):
    """The weights of a 2-way split: each process holds half of every layer's projections
    (then FSDP2's share of that) and all of the rest."""
    from keel.plan import DeviceSpec
    from keel.plan.planner import plan_run

    model = _meta("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    model.config.save_pretrained(tmp_path)
    devices = DeviceSpec(kind="cuda", per_node=4, memory_bytes=80 * 2**30)
    whole, split = (
        plan_run(_config(**{"model.path": str(tmp_path), "method.type": "full",
                            "distributed.tensor_parallel": tp}), devices=devices)
        for tp in (1, 2)
    )  # fmt: skip
    named = dict(model.named_parameters())
    split_names = [n for n in named if any(f".{path}." in n for path in LLAMA_STYLES)]
    layers = sum(named[n].numel() for n in split_names) * 4  # fp32
    rest = sum(p.numel() for n, p in named.items() if n not in split_names) * 4
    buffers = sum(b.numel() for b in model.buffers()) * 4  # whole on every process
    fsdp = whole.option_for(Strategy.FSDP, "full", False)
    tensor = split.option_for(Strategy.FSDP, "full", False)
    assert fsdp.per_device.params == (layers + rest) // 4 + buffers  # sharded over 4
    assert tensor.per_device.params == layers // 2 // 2 + rest // 2 + buffers  # split, sharded
    from keel.plan.report import to_json

    doc = to_json(split)
    assert doc["model"]["whole_params"] == sum(named[n].numel() for n in named)
    assert doc["model"]["params"] < doc["model"]["whole_params"]
    assert doc["devices"]["tensor_parallel"] == 2
    assert split.devices.dp_size == 2 and {o.strategy for o in split.options} == {
        Strategy.FSDP,
        Strategy.FSDP_OFFLOAD,
    }
