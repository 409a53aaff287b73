"""The activation formula (keel.plan.activations) against autograd's own saved tensors.

A random Llama runs the forward keel trains with (decoder, hidden states at target
positions, chunked loss, as CausalLMObjective's fast head does); every tensor autograd
saves for backward is recorded by storage, parameters left out. The formula must land
within 3% of that count, for each method and dtype regime.
"""

import contextlib
import weakref

import pytest
import torch

from keel.config.schema import FreezeConfig, LoraConfig, MethodConfig, OftConfig, QatConfig
from keel.losses import IGNORE_INDEX, chunked_cross_entropy
from keel.models import apply_method
from keel.models.attention import SEQ_LENS, VARLEN_ATTENTION, register_varlen_attention
from keel.models.qat import fake_quantize
from keel.plan.activations import Regime, Shapes, activation_bytes, autocast_copy_bytes
from keel.plan.architecture import build_meta_model
from keel.plan.census import take_census
from keel.precision import Precision

ROWS, SEQ = 2, 64


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=SEQ,
    )


def saved_bytes(model, batch, autocast) -> int:
    """Bytes of the distinct storages autograd saves during the forward (no parameters)
    and still holds when it ends: a graph dropped in forward (DoRA's detached weight norm)
    frees what it saved."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        saved.append(weakref.ref(tensor))
        return tensor

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        hidden = lm.get_decoder()(
            input_ids=batch["input_ids"],
            use_cache=False,
            position_ids=batch["position_ids"],
            **batch.get("attention", {}),
        ).last_hidden_state
        mask = batch["targets"] != IGNORE_INDEX  # [B, T]
        loss = chunked_cross_entropy(
            hidden[mask], batch["targets"][mask], lm.get_output_embeddings(), chunk_size=1024
        )
    # storages by address once the forward is over: a freed one's address may be reused
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (ref() for ref in saved)
        if t is not None and t.untyped_storage().data_ptr() not in params
    }
    del loss  # the graph, and what it saved, lived until here
    return sum(held.values())


CASES = {
    "full fp32": dict(method="full"),
    "lora fp32": dict(method="lora"),
    "lora with dropout": dict(method="lora", dropout=0.1),
    "freeze": dict(method="freeze"),
    "full packed": dict(method="full", packed=True),
    # the same samples as one padding-free row on keel's varlen attention: no [T, T] mask
    "full packed, padding-free": dict(method="full", packed=True, padding_free=True),
    "lora packed, padding-free, bf16 autocast": dict(
        method="lora", packed=True, padding_free=True, autocast=True
    ),
    "full bf16 autocast": dict(method="full", autocast=True),
    "lora bf16 autocast": dict(method="lora", autocast=True),
    "lora bf16 weights": dict(method="lora", dtype=torch.bfloat16, autocast=True),
    "lora bf16 weights, dropout": dict(
        method="lora", dtype=torch.bfloat16, autocast=True, dropout=0.1
    ),
    "dora fp32": dict(method="lora", dora=True),
    "dora bf16 autocast": dict(method="lora", dora=True, autocast=True),
    "dora bf16 weights, dropout": dict(
        method="lora", dora=True, dtype=torch.bfloat16, autocast=True, dropout=0.1
    ),
    # OFT: a reordered copy of each adapted layer's input, and per block the rotations'
    # Cayley transforms (Neumann series: cast copies under autocast; exact: a solve)
    "oft fp32": dict(method="oft"),
    "oft blocks of 16, packed, padding-free": dict(
        method="oft", block=16, packed=True, padding_free=True
    ),
    "oft bf16 autocast": dict(method="oft", autocast=True),
    "oft bf16 weights": dict(method="oft", dtype=torch.bfloat16, autocast=True),
    "oft exact fp32": dict(method="oft", exact=True),
    "oft exact bf16 autocast": dict(method="oft", exact=True, autocast=True),
    # method.qat: torchao's rounding saves several times a plain linear's tensors
    "qat int8-int4 fp32": dict(method="full", qat="int8-int4"),
    "qat int8-int4 bf16 autocast, freeze": dict(method="freeze", qat="int8-int4", autocast=True),
    "qat int4 bf16 weights": dict(method="full", qat="int4", dtype=torch.bfloat16, autocast=True),
    "qat fp8 fp32, freeze": dict(method="freeze", qat="fp8"),
    "qat fp8 bf16 autocast": dict(method="full", qat="fp8", autocast=True),
}


@pytest.mark.parametrize("case", CASES)
def test_saved_tensors_match_the_formula(case):
    kw = CASES[case]
    config = llama_config()
    dtype = kw.get("dtype", torch.float32)
    method = MethodConfig(
        type=kw["method"],
        lora=LoraConfig(r=8, dropout=kw.get("dropout", 0.0), dora=kw.get("dora", False)),
        freeze=FreezeConfig(trainable_layers=2),
        qat=QatConfig(scheme=kw.get("qat", "none")),
        oft=OftConfig(block_size=kw.get("block", 32), cayley_neumann=not kw.get("exact")),
    )
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = apply_method(LlamaForCausalLM(config).to(dtype), method, log=lambda _m: None)
    if "qat" in kw:
        pytest.importorskip("torchao")
        fake_quantize(model, method.qat)
    model.train()
    ids = torch.randint(0, config.vocab_size, (ROWS, SEQ))
    positions = torch.arange(SEQ).repeat(ROWS, 1)  # [B, T]
    positions[:, SEQ // 2 :] -= SEQ // 2  # two packed samples per row
    batch = {
        "input_ids": ids,
        "targets": ids,
        "position_ids": positions if kw.get("packed") else None,
    }
    attn = "sdpa"
    if kw.get("padding_free"):  # the micro-batch's rows laid end to end
        register_varlen_attention()
        (model.get_base_model() if method.uses_adapter else model).set_attn_implementation(
            VARLEN_ATTENTION
        )
        batch = {key: value.reshape(1, -1) for key, value in batch.items()}
        batch["attention"] = {SEQ_LENS: (SEQ // 2,) * (2 * ROWS)}
        attn = VARLEN_ATTENTION
    measured = saved_bytes(model, batch, kw.get("autocast", False))

    precision = Precision("bf16" if kw.get("autocast") else "fp32", "test")
    census = take_census(
        build_meta_model(config, dtype=dtype), method, copy_first=False, precision=precision
    )
    shapes = Shapes.from_config(config)
    regime = Regime.of(
        precision=precision,
        param_itemsize=census.param_itemsize,
        fsdp_mixed=False,
        cpu=True,
    )
    saved = activation_bytes(
        census,
        shapes,
        regime,
        tokens=ROWS * SEQ,
        seq=SEQ,
        checkpointing=False,
        packed=kw.get("packed", False),
        attn=attn,
    )
    # autocast's weight copies are saved too; the output layer's only inside the loss's
    # checkpoint, so not during the forward.
    copies = autocast_copy_bytes(census, shapes, regime, checkpointing=False)
    copies -= regime.compute * shapes.vocab * shapes.hidden if regime.weight_copies else 0
    predicted = saved.kept + copies
    assert predicted == pytest.approx(measured, rel=0.03), (predicted, measured)


# Mixture-of-experts blocks (transformers 5's fused experts, grouped matmuls), and Qwen3's
# per-head q_norm and k_norm: (model type, method, bf16 autocast)
MOE_CASES = {
    "qwen3-moe full fp32": ("qwen3_moe", "full", False),
    "qwen3-moe lora bf16 autocast": ("qwen3_moe", "lora", True),
    "mixtral freeze fp32": ("mixtral", "freeze", False),
    "mixtral full bf16 autocast": ("mixtral", "full", True),
    "qwen2-moe (shared expert) lora fp32": ("qwen2_moe", "lora", False),
    "qwen3 dense full fp32": ("qwen3", "full", False),
    # LoRA on the fused experts too: W + BA formed per forward, kept for backward
    "qwen3-moe lora on the experts fp32": ("qwen3_moe", "lora-experts", False),
    "mixtral lora on the experts bf16 autocast": ("mixtral", "lora-experts", True),
}


@pytest.mark.parametrize("case", MOE_CASES)
def test_mixture_of_experts_blocks_match_the_formula(case):
    """Each token goes through 4 of 8 experts whose width (48) is not the config's dense
    intermediate_size (160): a formula that read the dense MLP would be off by tens of
    percent (it was, before experts were counted)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, method_type, autocast = MOE_CASES[case]
    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=128, intermediate_size=160,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_local_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
        shared_expert_intermediate_size=40, tie_word_embeddings=False,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    experts = ["experts.gate_up_proj", "experts.down_proj"] if "experts" in method_type else []
    method = MethodConfig(
        type=method_type.split("-")[0],
        lora=LoraConfig(r=8, dropout=0.0, target_parameters=experts),
        freeze=FreezeConfig(trainable_layers=2),
    )
    torch.manual_seed(0)
    model = apply_method(AutoModelForCausalLM.from_config(config), method, log=lambda _m: None)
    model.train()
    ids = torch.randint(0, config.vocab_size, (ROWS, SEQ))
    batch = {"input_ids": ids, "targets": ids, "position_ids": None}
    measured = saved_bytes(model, batch, autocast)

    precision = Precision("bf16" if autocast else "fp32", "test")
    census = take_census(
        build_meta_model(config, dtype=torch.float32), method, copy_first=False, precision=precision
    )
    shapes = Shapes.from_config(config)
    regime = Regime.of(
        precision=precision, param_itemsize=census.param_itemsize, fsdp_mixed=False, cpu=True
    )
    saved = activation_bytes(
        census, shapes, regime, tokens=ROWS * SEQ, seq=SEQ, checkpointing=False, packed=False,
        attn="sdpa",
    )  # fmt: skip
    copies = autocast_copy_bytes(census, shapes, regime, checkpointing=False)
    copies -= regime.compute * shapes.vocab * shapes.hidden if regime.weight_copies else 0
    assert saved.kept + copies == pytest.approx(measured, rel=0.03)
