"""Single-process pieces of keel.distributed and the meta-device loader."""

import pytest
import torch
from torch import nn

from keel.distributed.process_group import (
    DistContext,
    backend_for,
    explain_startup_error,
    main_rank_first,
    on_main,
)
from keel.distributed.strategy import Strategy, choose_strategy, configured_strategy
from keel.models.materialize import (
    Starts,
    allocate,
    build_empty_model,
    checkpoint_key,
    fill_weights,
    init_computed_buffers,
    initial_value,
)

GIB = 2**30


def test_backend_always_has_a_cpu_backend():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(
    "replica,device,want",
    [
        (10 * GIB, 80 * GIB, "ddp"),  # fits: replicate
        (70 * GIB, 80 * GIB, "fsdp"),  # more than 80%: shard
    ],
)
def test_auto_strategy_shards_only_what_does_not_fit(replica, device, want):
    strategy, why = choose_strategy(None, 2, replica, device)
    assert strategy == want and "GiB" in why
    assert choose_strategy(None, 1, replica, device)[0] is Strategy.SINGLE
    assert choose_strategy(Strategy.DDP, 2, 70 * GIB, 80 * GIB)[0] is Strategy.DDP  # explicit


@pytest.mark.parametrize(
    "requested,cpu_offload,dp_size,cuda,want",
    [
        ("auto", False, 2, True, None),  # auto: decided from memory
        ("ddp", True, 2, True, Strategy.DDP),  # offload is an fsdp setting
        ("fsdp", False, 2, True, Strategy.FSDP),
        ("fsdp", True, 2, True, Strategy.FSDP_OFFLOAD),
        ("fsdp", True, 2, False, Strategy.FSDP),  # a CPU has nothing to offload from
        ("fsdp", True, 1, True, Strategy.SINGLE),  # one process: no wrapper
    ],
)
def test_one_decider_from_config_words_to_a_strategy(requested, cpu_offload, dp_size, cuda, want):
    """The YAML's words (distributed.strategy, distributed.fsdp.cpu_offload) map to the one
    vocabulary the planner, the trainer and model set-up share."""
    got = configured_strategy(requested, cpu_offload=cpu_offload, dp_size=dp_size, cuda=cuda)
    assert got is want
    if got is not None and got is not Strategy.SINGLE:
        assert got.config_value == requested


@pytest.mark.parametrize(
    "message,expected",
    [
        (
            "The server socket has failed to listen on any local network address. "
            "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
            "already in use",
        ),
        (
            "Timed out after 301 seconds waiting for clients. 1/2 clients joined.",
            "not all 2 processes joined",
        ),
        ("Invalid rank 3, rank should be in the interval [0, 1]", "disagree on the world size"),
    ],
)
def test_startup_errors_are_explained(message, expected):
    text = explain_startup_error(RuntimeError(message), world_size=2)
    assert expected in text and "torch.distributed said" in text


def test_single_process_context_is_the_identity():
    ctx = DistContext()
    assert ctx.all_reduce_sum([1.5, 2]) == [1.5, 2]
    assert ctx.broadcast_object({"a": 1}) == {"a": 1}
    assert ctx.gather_objects(3) == [3]
    with main_rank_first(ctx):
        pass
    assert on_main(ctx, lambda: 7) == 7


def test_checkpoint_keys_of_peft_parameters():
    assert (
        checkpoint_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert checkpoint_key("model.norm.weight") == "model.norm.weight"


def test_adapter_init_depends_on_seed_and_name_only():
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    a = initial_value(name, torch.Size([4, 32]), seed=1)
    assert torch.equal(a, initial_value(name, torch.Size([4, 32]), seed=1))
    assert not torch.equal(a, initial_value(name, torch.Size([4, 32]), seed=2))
    assert a.abs().max() <= 1 / 32**0.5  # kaiming-uniform(a=sqrt(5)) bound
    assert initial_value(name.replace("lora_A", "lora_B"), torch.Size([32, 4]), 1).eq(0).all()


def test_meta_built_model_equals_from_pretrained(tiny_model_dir):
    """Build on meta, allocate, load: same logits as from_pretrained, ties kept."""
    from keel.models import load_model

    reference = load_model(tiny_model_dir, dtype=torch.float32)
    model = build_empty_model(tiny_model_dir, dtype=torch.float32)
    allocate(model, torch.device("cpu"))
    init_computed_buffers(model)
    fill_weights(model, tiny_model_dir, Starts(seed=0), region_of=lambda p: None, local=lambda p: p)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0
        )


def fill_second_halves(model, model_dir, starts: Starts | None = None) -> dict[str, torch.Tensor]:
    """What rank 1 of 2 holds of each parameter of `model` (on meta): the second half of
    its rows, filled by fill_weights (from `starts`, else seed 0) as a shard is."""
    halves = {
        name: torch.empty((p.shape[0] + 1) // 2, *p.shape[1:])
        for name, p in model.named_parameters()
    }
    regions = {
        id(p): (slice(p.shape[0] - (p.shape[0] + 1) // 2, p.shape[0]),) for p in model.parameters()
    }
    by_id = {id(p): halves[n] for n, p in model.named_parameters()}
    fill_weights(
        model,
        model_dir,
        starts or Starts(seed=0),
        region_of=lambda p: regions[id(p)],
        local=lambda p: by_id[id(p)],
    )
    return halves


def test_fill_reads_only_the_region_a_shard_holds(tiny_model_dir):
    """What a rank of 2 would read: the second half of every weight's rows."""
    from keel.models import load_model

    reference = dict(load_model(tiny_model_dir, dtype=torch.float32).named_parameters())
    model = build_empty_model(tiny_model_dir, dtype=torch.float32)
    halves = fill_second_halves(model, tiny_model_dir)
    for name, half in halves.items():
        torch.testing.assert_close(half, reference[name][-half.shape[0] :])
    assert isinstance(model.lm_head, nn.Linear)


def test_a_shard_of_a_moe_model_stacks_only_the_experts_it_holds(tmp_path):
    """Mixtral's checkpoint stores each expert's w1/w3/w2 apart, the model one
    [experts, ...] tensor per projection: rank 1 of 2 (experts 1 and 2 of 3) reads and
    stacks its experts' tensors, gate before up, as from_pretrained fuses them."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from keel.models import load_model

    config = AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=3,
        num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        keys = set(stored.keys())
        w3 = stored.get_tensor("model.layers.0.block_sparse_moe.experts.2.w3.weight")
    assert "model.layers.0.block_sparse_moe.experts.2.w1.weight" in keys
    reference = dict(load_model(tmp_path, dtype=torch.float32).named_parameters())
    halves = fill_second_halves(build_empty_model(tmp_path, dtype=torch.float32), tmp_path)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert halves[fused].shape == (2, 48, 16)
    torch.testing.assert_close(halves[fused][1, 24:], w3)  # expert 2's up, after its gate
    for name, half in halves.items():
        torch.testing.assert_close(half, reference[name][-half.shape[0] :])


def _dora_on_meta(model_dir):
    from keel.config.schema import LoraConfig, MethodConfig
    from keel.models import apply_method

    model = build_empty_model(model_dir, dtype=torch.float32)
    method = MethodConfig(type="lora", lora=LoraConfig(r=4, dora=True, dropout=0.0))
    with torch.device("meta"):
        return apply_method(model, method, log=lambda _m: None)


def test_dora_starts_from_the_base_model_exactly(tiny_model_dir):
    """Each magnitude starts at its weight rows' norms (B is zero): the base's logits."""
    from keel.models import load_model

    reference = load_model(tiny_model_dir, dtype=torch.float32)
    model = _dora_on_meta(tiny_model_dir)
    allocate(model, torch.device("cpu"))
    init_computed_buffers(model.get_base_model())
    fill_weights(model, tiny_model_dir, Starts(seed=0), region_of=lambda p: None, local=lambda p: p)
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    torch.testing.assert_close(
        q.lora_magnitude_vector["default"].weight, q.base_layer.weight.norm(dim=1)
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_a_shard_computes_the_magnitudes_of_the_rows_it_holds(tiny_model_dir):
    """FSDP2 splits a weight and its magnitude by the same rows: the second half's norms."""
    from keel.models import load_model

    reference = dict(load_model(tiny_model_dir, dtype=torch.float32).named_parameters())
    halves = fill_second_halves(_dora_on_meta(tiny_model_dir), tiny_model_dir)
    name = "base_model.model.model.layers.1.mlp.down_proj"
    weight = reference["model.layers.1.mlp.down_proj.weight"]
    want = weight[-halves[f"{name}.lora_magnitude_vector.default.weight"].shape[0] :].norm(dim=1)
    torch.testing.assert_close(halves[f"{name}.lora_magnitude_vector.default.weight"], want)
