"""Every decoder family keel supports, built through keel's real loading path.

For each family a tiny random model is saved, built by `build_training_model` (meta device,
allocate, computed buffers, weights from safetensors) and its training loss compared with
the Hugging Face forward of `from_pretrained` on the same target tokens, rtol 1e-5. The
model's logits are scaled to a trained model's magnitude (tens), so a head that soft-caps
or rescales them cannot hide behind the ~0.1 logits of random weights. Families whose
forward post-processes logits must take the full forward; plain heads the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from keel.config.schema import DataConfig, MethodConfig, ModelConfig, OutputConfig, RunConfig
from keel.data import collate
from keel.distributed.parallel_dims import ParallelDims
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy
from keel.errors import ModelError
from keel.models.attention import VARLEN_ATTENTION
from keel.precision import Precision
from keel.train.model_setup import build_training_model
from keel.train.objective import causal_lm_of

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Granite's multipliers act inside the decoder, so the fast head must stay exact. Not Granite
# 3's 12 / 0.22: with those a random decoder barely moves the loss, which could then not
# tell garbage rotary buffers from good ones.
GRANITE = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.05)
# Families whose attention keel's padding-free probe turns down (they fall back to padded
# micro-batches): attention that does not go through transformers' attention interface.
NOT_VARLEN = {"stablelm", "nemotron"}
LOGIT_MAGNITUDE = 30.0  # max |logit| of the saved models: a trained model's range
REL = 1e-5


@dataclass(frozen=True)
class Family:
    model_type: str
    fast: bool  # the head is output_embeddings(hidden): the fast path must be taken
    overrides: dict = field(default_factory=dict)
    attn: str = "sdpa"


FAMILIES = {
    "llama": Family("llama", True),
    "mistral": Family("mistral", True),
    "qwen2": Family("qwen2", True),
    "qwen3": Family("qwen3", True),
    "gemma": Family("gemma", True),
    # Gemma 2 soft-caps attention scores, which only the eager attention implements.
    "gemma2": Family("gemma2", False, dict(final_logit_softcapping=30.0), attn="eager"),
    "gemma3_text": Family("gemma3_text", True),
    "gemma3_text-softcap": Family("gemma3_text", False, dict(final_logit_softcapping=30.0)),
    "phi3": Family("phi3", True),
    "olmo2": Family("olmo2", True),
    "granite": Family("granite", False, dict(logits_scaling=8.0, **GRANITE)),
    "granite-unscaled": Family("granite", True, dict(logits_scaling=1.0, **GRANITE)),
    "cohere": Family("cohere", False, dict(logit_scale=0.25)),
    "starcoder2": Family("starcoder2", True),
    "smollm3": Family("smollm3", True),
    "olmo": Family("olmo", True),
    "olmo3": Family("olmo3", True),
    "phi": Family("phi", True),
    "cohere2": Family("cohere2", False, dict(logit_scale=0.25)),
    "glm": Family("glm", True),
    "glm4": Family("glm4", True),
    "helium": Family("helium", True),
    "stablelm": Family("stablelm", True),
    "nemotron": Family("nemotron", True),
    "exaone4": Family("exaone4", True),
    "ministral": Family("ministral", True),
    "seed_oss": Family("seed_oss", True),
    "internlm3": Family("internlm3", True),
    "ernie4_5": Family("ernie4_5", True),
    "hunyuan_v1_dense": Family("hunyuan_v1_dense", True),
    "arcee": Family("arcee", True),
    "jetmoe": Family("jetmoe", True, MOE),
    # Checkpoints store one tensor per expert, the model one [experts, ...] tensor: keel's
    # loader stacks them as transformers does (keel.models.checkpoint_names).
    "qwen3_moe": Family("qwen3_moe", True, MOE),
    "qwen2_moe": Family("qwen2_moe", True, dict(shared_expert_intermediate_size=32, **MOE)),
    "mixtral": Family("mixtral", True, MOE),
    "olmoe": Family("olmoe", True, MOE),
    "granitemoe": Family("granitemoe", True, MOE),  # stored fused already
    # dense first layers, then experts with a shared one
    "glm4_moe": Family(
        "glm4_moe", True, dict(n_routed_experts=4, first_k_dense_replace=1, n_group=1, **MOE)
    ),
    "ernie4_5_moe": Family("ernie4_5_moe", True, dict(moe_num_experts=4, moe_k=2, **MOE)),
    # get_decoder() returns the *ForCausalLM itself, so there is no hidden state to take.
    "llama4_text": Family("llama4_text", False, dict(intermediate_size_mlp=128, **MOE)),
    "vaultgemma": Family("vaultgemma", False, dict(final_logit_softcapping=30.0), attn="eager"),
}


def tiny_config(family: Family):
    from transformers import AutoConfig

    return AutoConfig.for_model(family.model_type, **{**TINY, **family.overrides})


def save_tiny_model(config, path, *, logit_magnitude: float | None = LOGIT_MAGNITUDE):
    """Save a random model whose pre-post-processing max |logit| is ~`logit_magnitude`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if logit_magnitude is not None:
        with torch.no_grad():
            scale_logits(model, logit_magnitude)
    model.save_pretrained(path)
    return path


def scale_logits(model, magnitude: float) -> None:
    """Scale output_embeddings(decoder hidden state) to max |logit| = `magnitude`.

    Untied: the output layer. Tied: the final norm, since scaling the shared matrix would
    also scale the input embeddings until they drown what the decoder layers add.
    """
    head, decoder = model.get_output_embeddings(), model.model
    hidden = decoder(input_ids=torch.arange(3, 35)[None]).last_hidden_state  # [1, 32, H]
    k = magnitude / head(hidden).abs().amax()
    if head.weight is not model.get_input_embeddings().weight:
        head.weight.mul_(k)
        return
    norm = getattr(decoder, "norm", None) or decoder.final_layernorm
    x = torch.randn(4, hidden.shape[-1])  # [4, H]
    want = norm(x) * k
    weight = norm.weight.clone()
    norm.weight.mul_(k)
    if getattr(norm, "bias", None) is not None:
        norm.bias.mul_(k)
    if not torch.allclose(norm(x), want, rtol=1e-4, atol=1e-5):  # Gemma: x * (1 + weight)
        norm.weight.copy_((1 + weight) * k - 1)
    assert torch.allclose(norm(x), want, rtol=1e-4, atol=1e-5), type(norm)


def build(
    path,
    family: Family,
    *,
    method: str = "full",
    checkpointing: bool = False,
    dtype: str = "auto",
    dist: DistContext | None = None,
):
    """keel's training model for `path`, and what build_training_model logged."""
    cfg = RunConfig(
        model=ModelConfig(path=str(path), attn_implementation=family.attn, dtype=dtype),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(path / "out")),
        method=MethodConfig(type=method),
    )
    cfg.train.gradient_checkpointing = checkpointing
    lines: list[str] = []
    dist = dist or DistContext()
    built = build_training_model(cfg, path, dist, Precision("fp32", "test"), lines.append)
    return built, lines


def samples() -> list[tuple[list[int], list[int]]]:
    """(input_ids, targets) of five samples; each starts with two prompt (-100) targets."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for n in (12, 5, 7, 9, 3):
        tokens = torch.randint(3, VOCAB, (n + 1,), generator=generator).tolist()
        out.append((tokens[:-1], [-100, -100, *tokens[3:]]))
    return out


# Samples per batch row: alone, packed with restarting positions, and right-padded.
ROWS = ((0,), (1, 2), (3,), (4, 1))


def keel_batch(samples, padding_free: bool = False) -> dict[str, torch.Tensor]:
    rows = []
    for indices in ROWS:
        group = [samples[i] for i in indices]
        rows.append(
            {
                "input_ids": [t for ids, _ in group for t in ids],
                "targets": [t for _, tg in group for t in tg],
                "position_ids": [p for ids, _ in group for p in range(len(ids))],
            }
        )
    return collate(rows, pad_id=0, padding_free=padding_free)


def hugging_face_model(path, family: Family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=family.attn
    ).eval()


def hugging_face_loss(path, family: Family, samples, model=None) -> tuple[float, int]:
    """Summed CE and target count of `from_pretrained`'s logits over the samples in ROWS,
    each run on its own (fp32, eval): no packing, no padding."""
    model = hugging_face_model(path, family) if model is None else model
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ids, targets in (samples[i] for indices in ROWS for i in indices):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]  # [T, V]
            total += F.cross_entropy(logits.float(), torch.tensor(targets), reduction="sum")
            count += sum(t != -100 for t in targets)
    return float(total), count


def keel_loss(objective, samples) -> tuple[float, int]:
    """The objective's loss on the samples in ROWS, laid out as training lays them out:
    padding-free when the model runs keel's varlen attention, right-padded otherwise."""
    attention = causal_lm_of(objective.model).config._attn_implementation
    with torch.no_grad():
        out = objective.eval()(keel_batch(samples, attention == VARLEN_ATTENTION))
    return float(out.loss), int(out.count)


def assert_loss_sees_computed_buffers(path, family: Family, reference, want: float) -> None:
    """The comparison has power: doubling the buffers a meta-device build must recompute
    (rotary frequencies, embedding scales) moves the loss by far more than REL."""
    with torch.no_grad():
        for module in reference.modules():
            for name, buf in module.named_buffers(recurse=False):
                if name in module._non_persistent_buffers_set and buf.is_floating_point():
                    buf.mul_(2.0)
    perturbed, _ = hugging_face_loss(path, family, samples(), reference)
    assert abs(perturbed - want) > 10 * REL * want, (perturbed, want)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_keel_loss_equals_hugging_face_loss(name, tmp_path):
    family = FAMILIES[name]
    path = save_tiny_model(tiny_config(family), tmp_path / name)
    built, lines = build(path, family)
    reference = hugging_face_model(path, family)
    want, count = hugging_face_loss(path, family, samples(), reference)
    got, n = keel_loss(built.objective, samples())
    assert n == count
    assert_loss_sees_computed_buffers(path, family, reference, want)
    assert built.objective.fast_head is family.fast, lines
    head_lines = [line for line in lines if line.startswith("loss head: ")]
    assert len(head_lines) == 1
    assert head_lines[0].startswith(
        "loss head: fast" if family.fast else "loss head: full Hugging Face forward"
    ), head_lines
    layout_lines = [line for line in lines if line.startswith("micro-batches: ")]
    assert len(layout_lines) == 1, lines
    # The probe decides per family (stablelm and nemotron call sdpa themselves); eager
    # families never take it. The loss must match either way.
    assert built.padding_free is (family.attn == "sdpa" and name not in NOT_VARLEN), layout_lines
    assert got == pytest.approx(want, rel=REL), (got, want)


def test_forcing_the_fast_head_on_granite_gives_a_different_loss(tmp_path):
    """Negative control: the comparison above fails when the wrong head is used."""
    family = FAMILIES["granite"]
    path = save_tiny_model(tiny_config(family), tmp_path / "granite")
    built, _ = build(path, family)
    built.objective.fast_head = True
    got, _ = keel_loss(built.objective, samples())
    want, _ = hugging_face_loss(path, family, samples())
    assert abs(got - want) > 1e4 * REL * want, (got, want)


def test_probe_sees_soft_capping_that_random_weights_hide(tmp_path):
    """At a fresh model's |logit| ~ 0.1, cap * tanh(x / cap) = x to ~1e-7: a plain head gives
    the Hugging Face loss on real tokens, and only the probe's logits ~50 check tells."""
    family = FAMILIES["gemma2"]
    path = save_tiny_model(tiny_config(family), tmp_path / "gemma2", logit_magnitude=0.1)
    built, _ = build(path, family)
    objective = built.objective
    objective.fast_head = True
    got, _ = keel_loss(objective, samples())
    want, _ = hugging_face_loss(path, family, samples())
    assert got == pytest.approx(want, rel=REL)  # the trap a loss comparison alone falls into
    ok, why = objective.check_fast_head()
    assert not ok and "at logits ~50:" in why and "real tokens and" not in why, why


@pytest.mark.parametrize("name", ["llama", "granite"])
def test_probe_under_lora_and_gradient_checkpointing(name, tmp_path):
    family = FAMILIES[name]
    path = save_tiny_model(tiny_config(family), tmp_path / name)
    built, lines = build(path, family, method="lora", checkpointing=True)
    objective = built.objective
    assert objective.fast_head is family.fast, lines
    objective.train()
    objective.model.get_base_model().lm_head.eval()  # a mixed state, restored as it was
    before = [m.training for m in objective.modules()]
    assert objective.check_fast_head()[0] is family.fast
    assert [m.training for m in objective.modules()] == before
    want, _ = hugging_face_loss(path, family, samples())
    assert keel_loss(objective, samples())[0] == pytest.approx(want, rel=REL)  # LoRA B = 0


@pytest.mark.parametrize("name", ["llama", "granite"])
def test_probe_tolerance_follows_bf16_weights(name, tmp_path):
    family = FAMILIES[name]
    path = save_tiny_model(tiny_config(family), tmp_path / name)
    built, lines = build(path, family, dtype="bfloat16")
    assert built.objective.fast_head is family.fast, lines
    assert any("tolerance rel 0.016 (bfloat16)" in line for line in lines), lines


def test_a_checkpoint_transformers_converts_otherwise_is_refused(tmp_path):
    """HRM stores its gate and up projections as one tensor that transformers splits
    while loading: not a renaming or a stack of experts, so keel's loader refuses it
    before allocating anything, naming the conversion."""
    config = tiny_config(Family("hrm_text", True))
    path = save_tiny_model(config, tmp_path / "hrm", logit_magnitude=None)
    with pytest.raises(ModelError, match="through Chunk .* keel cannot train model_type hrm_text"):
        build(path, Family("hrm_text", True))


def test_gemma2_under_sdpa_is_refused_with_the_fix(tmp_path):
    path = save_tiny_model(
        tiny_config(FAMILIES["gemma2"]), tmp_path / "gemma2", logit_magnitude=None
    )
    with pytest.raises(ModelError, match="set model.attn_implementation: eager"):
        build(path, Family("gemma2", False))


@pytest.mark.parametrize("name", ["llama", "granite"])
def test_probe_runs_through_the_fsdp_root_unit(name, tmp_path, monkeypatch):
    """Under FSDP2 the output layer is a sharded DTensor outside a forward; the probe works
    because it runs inside the objective's forward, where the root hooks gather it. One
    process (a 1-rank mesh) shards the same way; tests/distributed/test_parity.py runs two."""
    import torch.distributed as dist

    from keel.train import model_setup

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    family = FAMILIES[name]
    path = save_tiny_model(tiny_config(family), tmp_path / name)
    forced = (Strategy.FSDP, "forced by test")
    monkeypatch.setattr(model_setup, "choose_strategy", lambda *_: forced)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        one_rank = DistContext(dims=ParallelDims.for_strategy(Strategy.FSDP, 1).build_mesh("cpu"))
        built, lines = build(path, family, dist=one_rank)
        assert built.strategy is Strategy.FSDP
        assert type(built.model.get_output_embeddings().weight).__name__ == "DTensor"
        assert built.objective.fast_head is family.fast, lines
        want, _ = hugging_face_loss(path, family, samples())
        assert keel_loss(built.objective, samples())[0] == pytest.approx(want, rel=REL)
    finally:
        dist.destroy_process_group()
