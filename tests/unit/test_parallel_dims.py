"""ParallelDims: the degrees are checked, the data-parallel rank and size come from them, and
the one mesh gives the dp sub-mesh every `apply_*` takes (one process, torch's fake backend
standing in for 4 ranks: building a mesh and sharding on the meta device send nothing)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from keel.distributed.parallel_dims import ParallelDims
from keel.distributed.parallelize import ParallelizeSettings, fsdp_units, parallelize
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import STRATEGIES, Strategy
from keel.errors import KeelError


@pytest.mark.parametrize(
    "degrees,fragment",
    [
        (dict(dp_replicate=2, dp_shard=2, world_size=8), "= 4, but the world has 8"),
        (dict(dp_replicate=1, dp_shard=0, world_size=1), "dp_shard = 0"),
        (dict(dp_replicate=1, dp_shard=2, tp=2, cp=2, world_size=8), "not both"),
        (dict(dp_replicate=2, dp_shard=2, cp=2, world_size=8), "with HSDP"),
    ],
)
def test_degrees_that_do_not_describe_the_world_are_refused(degrees, fragment):
    with pytest.raises(KeelError, match=fragment):
        ParallelDims(**degrees)


def test_the_data_parallel_rank_and_size():
    one = DistContext()
    assert (one.dp_rank, one.dp_size, one.mesh) == (0, 1, None)
    ctx = DistContext(rank=3, world_size=4, dims=ParallelDims.for_strategy(Strategy.DDP, 4))
    assert (ctx.dp_rank, ctx.dp_size) == (3, 4)
    sharded = ctx.dims.with_strategy(Strategy.FSDP_OFFLOAD)
    assert (sharded.dp_replicate, sharded.dp_shard, sharded.dp_size) == (1, 4, 4)
    assert ctx.dims.with_strategy(Strategy.SINGLE) == ctx.dims  # single replicates too


def test_one_strategy_vocabulary():
    assert [str(s) for s in STRATEGIES] == ["single", "ddp", "fsdp", "fsdp_offload"]
    assert [s.shards for s in STRATEGIES] == [False, False, True, True]
    assert [s.replicates for s in STRATEGIES] == [False, True, False, False]
    assert Strategy.FSDP_OFFLOAD.config_value == "fsdp"  # + distributed.fsdp.cpu_offload


@pytest.fixture
def four_fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()


def test_the_mesh_names_its_data_parallel_axis(four_fake_ranks):
    dims = ParallelDims.for_strategy(Strategy.FSDP, 4).build_mesh("cpu")
    assert dims.mesh.mesh_dim_names == ("dp",)
    # 1 x N and N x 1 are the same one-axis mesh on the default group: no new communicator
    assert dims.dp_mesh() is dims.mesh
    assert dims.with_strategy(Strategy.DDP).dp_mesh() is dims.mesh
    assert dims.mesh.get_group() is dist.group.WORLD
    assert dims.mesh.get_local_rank() == 1
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4).build_mesh("cpu")
    dp = hsdp.dp_mesh()
    assert dp.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert (dp["dp_replicate"].get_local_rank(), dp["dp_shard"].get_local_rank()) == (0, 1)


def test_context_parallel_groups_read_the_same_rows(four_fake_ranks):
    """2 groups of 2 (rank 1 of 4 here): its group (ranks 0, 1) reads the rows of
    data-parallel rank 0; gradients are averaged and FSDP2 shards over all 4."""
    dims = ParallelDims.for_strategy(Strategy.DDP, 4).build_mesh("cpu")
    split = dims.with_context(2, "cpu")
    assert (split.dp_size, split.grad_size, split.cp) == (2, 4, 2)
    assert [split.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [split.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert split.cp_mesh["cp"].size() == 2 and split.cp_mesh["cp"].get_local_rank() == 1
    sharded = split.with_strategy(Strategy.FSDP)
    assert (sharded.dp_shard, sharded.cp, sharded.dp_mesh()) == (2, 2, dims.mesh)
    assert sharded.dp_mesh().size() == 4
    ctx = DistContext(rank=1, world_size=4, dims=sharded)
    assert (ctx.dp_rank, ctx.dp_size, ctx.cp_rank, ctx.cp_size, ctx.grad_size) == (0, 2, 1, 2, 4)
    with pytest.raises(KeelError, match="shards over every process under context"):
        split.with_strategy(Strategy.FSDP, 2)
    with pytest.raises(KeelError, match="does not divide the 4 processes"):
        dims.with_context(3, "cpu")
    assert dims.with_context(1, "cpu") is dims


def _tiny_lm() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_parallelize_shards_over_the_dims_mesh(four_fake_ranks):
    """FSDP2 takes the dp sub-mesh of the dims it is given; the policy's and the reference's
    settings differ only in the unit choice (untied embeddings a unit or not)."""
    dims = ParallelDims.for_strategy(Strategy.FSDP, 4).build_mesh("cpu")
    policy, reference = _tiny_lm(), _tiny_lm()
    layers = list(policy.model.layers)
    units = fsdp_units(policy, layers, embeddings=True)
    assert units[0] is policy.get_input_embeddings() and units[1:] == layers
    assert fsdp_units(reference, reference.model.layers, embeddings=False)[0] is not (
        reference.get_input_embeddings()
    )
    parallelize(policy, dims, ParallelizeSettings(strategy=Strategy.FSDP, units=units))
    weight = policy.model.layers[0].mlp.up_proj.weight
    assert isinstance(weight, DTensor) and weight.device_mesh is dims.mesh
    assert weight.placements == (Shard(0),)

    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4).build_mesh("cpu")
    replicated = ParallelizeSettings(strategy=Strategy.FSDP, units=list(reference.model.layers))
    parallelize(reference, hsdp, replicated)
    weight = reference.model.layers[0].mlp.up_proj.weight
    assert weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert weight.placements == (Replicate(), Shard(0))


def test_parallelize_replicates_over_the_dims_mesh(four_fake_ranks):
    dims = ParallelDims.for_strategy(Strategy.DDP, 4).build_mesh("cpu")
    model = nn.Linear(4, 4)
    ddp = parallelize(model, dims, ParallelizeSettings(strategy=Strategy.DDP))
    assert isinstance(ddp, DistributedDataParallel)
    assert ddp.process_group is dims.dp_mesh().get_group()
    single = ParallelizeSettings(strategy=Strategy.SINGLE)
    assert parallelize(model, dims, single) is model


def test_hsdp_groups_and_their_refusals():
    from keel.distributed.strategy import Strategy

    dims = ParallelDims(dp_replicate=8, dp_shard=1, world_size=8)
    hybrid = dims.with_strategy(Strategy.FSDP, 4)
    assert (hybrid.dp_replicate, hybrid.dp_shard, hybrid.hybrid) == (2, 4, True)
    assert hybrid.with_strategy(Strategy.FSDP) == hybrid  # a frozen copy sharded alike
    assert dims.with_strategy(Strategy.FSDP, 0).dp_shard == 8  # 0: over all
    assert dims.with_strategy(Strategy.FSDP, 8).hybrid is False
    assert hybrid.with_strategy(Strategy.DDP).dp_replicate == 8
    for bad in (3, 16, 1):
        with pytest.raises(KeelError, match="do not split into groups"):
            dims.with_strategy(Strategy.FSDP, bad)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({}, None),
        ({"train.stage": "dpo"}, None),
        ({"train.stage": "kto"}, None),
        ({"train.stage": "rm"}, None),
        ({"train.stage": "grpo"}, None),
        ({"train.padding_free": False}, "set train.padding_free true"),
        ({"distributed.fsdp.shard_size": 2}, "cannot be combined with it"),
        ({"train.router_aux_loss_coef": 0.01}, "routers' balance term"),
        ({"distributed.context_parallel": 0}, "must be a whole number of processes"),
        ({"model.attn_implementation": "eager"}, "eager is not split: use auto or sdpa"),
    ],
)
def test_context_parallel_is_checked_before_anything_loads(settings, problem, tmp_path):
    from config_support import run_config_with

    from keel.config.validate import check_config

    cfg = run_config_with(tmp_path, {"distributed.context_parallel": 2, **settings})
    found = [p for p in check_config(cfg) if "distributed.context_parallel" in p]
    assert (found == []) if problem is None else any(problem in p for p in found), found


@pytest.mark.parametrize(
    ("strategy", "shard_size", "problem"),
    [
        ("fsdp", 1, "shard_size = 1 shards nothing"),
        ("ddp", 4, "distributed.strategy = ddp shards nothing"),
        ("fsdp", -2, "shard_size = -2 must be >= 0"),
        ("auto", 4, None),
    ],
)
def test_shard_size_is_checked_before_anything_loads(strategy, shard_size, problem, tmp_path):
    from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
    from keel.config.validate import check_config

    cfg = RunConfig(
        model=ModelConfig(path=str(tmp_path)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "out")),
    )
    cfg.distributed.strategy, cfg.distributed.fsdp.shard_size = strategy, shard_size
    found = [p for p in check_config(cfg) if "shard" in p]
    assert (found == []) if problem is None else any(problem in p for p in found), found


def test_auto_attention_under_context_parallelism_is_sdpa():
    from keel.models.attention import requested_attention

    assert requested_attention("auto", 2) == "sdpa"  # not flash-attn, which is not split
    assert requested_attention("auto", 1) == "auto"
    assert requested_attention("sdpa", 2) == "sdpa"
