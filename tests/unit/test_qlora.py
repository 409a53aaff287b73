"""QLoRA: the NF4 base (torchao) and the bitsandbytes backend, on a tiny model.

Process-count parity (DDP and FSDP2 == one process) is in tests/distributed/test_parity.py.
"""

import json

import pytest
import torch
from cli_support import keel_in_process
from safetensors.torch import load_file
from test_train_run import config, quiet

from keel.errors import ConfigError, ModelError
from keel.export import ExportRequest, export_model
from keel.quant import layout
from keel.quant import nf4 as keel_nf4
from keel.train.run import run_training

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


def run(model_dir, data_file, out, *overrides, method="qlora"):
    overrides = ("method.lora.dropout=0.0", "train.max_steps=8", "data.val_size=0", *overrides)
    return run_training(config(model_dir, data_file, out, *overrides, method=method), log=quiet)


def nf4_of(value: torch.Tensor, rows: slice, mean: torch.Tensor):
    """Rows `rows` of `value` as keel loads them into an NF4 weight, dequantised."""
    size = layout.scaler_block(*value.shape)  # from the whole weight's shape, as in loading
    with torch.no_grad():
        target = nf4_tensor.to_nf4(torch.ones_like(value[rows]), 64, size)  # overwritten
    keel_nf4.fill_nf4(target, value[rows], mean)
    return target.get_original_weight()


def test_a_shard_is_quantised_as_the_same_rows_of_the_whole_weight():
    torch.manual_seed(0)
    value = torch.randn(64, 96) * torch.linspace(0.1, 3, 96)  # blocks of different ranges
    mean = keel_nf4.absmax_mean_of(lambda rows: value[rows], 64, 96, torch.float32)
    whole = nf4_of(value, slice(0, 64), mean)
    top, bottom = nf4_of(value, slice(0, 32), mean), nf4_of(value, slice(32, 64), mean)
    assert torch.equal(torch.cat([top, bottom]), whole)
    # NF4 is lossy but close: within the largest level gap (0.16) of each block's absmax.
    blocks = value.flatten().view(-1, 64)
    error = (whole.flatten().view(-1, 64) - blocks).abs().amax(dim=1)
    assert (error <= 0.17 * blocks.abs().amax(dim=1)).all()
    # torchao quantises the whole tensor the same way (its mean reduction may differ in
    # the last bit, which moves no code)
    reference = nf4_tensor.to_nf4(value, 64, layout.scaler_block(64, 96)).get_original_weight()
    torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-6)
    # negative control: a shard quantised with its own mean is not the whole's rows
    own = keel_nf4.absmax_mean_of(lambda rows: value[32:64][rows], 32, 96, torch.float32)
    assert not torch.equal(nf4_of(value, slice(32, 64), own), bottom)


def test_all_zero_blocks_stay_zero_and_finite():
    value = torch.randn(64, 96)
    value[:8] = 0.0  # 12 whole blocks of zeros (e.g. pruned rows)
    mean = keel_nf4.absmax_mean_of(lambda rows: value[rows], 64, 96, torch.float32)
    got = nf4_of(value, slice(0, 64), mean)
    assert torch.isfinite(got).all() and torch.equal(got[:8], value[:8])
    constant = torch.full((64, 96), 0.5)  # every absmax equals the mean
    mean = keel_nf4.absmax_mean_of(lambda rows: constant[rows], 64, 96, torch.float32)
    torch.testing.assert_close(nf4_of(constant, slice(0, 64), mean), constant)


def test_nf4_layout_is_chosen_from_the_shape_alone():
    assert layout.scaler_block(4096, 4096) == 256  # torchao's default on real sizes
    assert layout.quantizable(4096, 4096, world=8) and not layout.quantizable(4096, 4096, 3)
    assert layout.scaler_block(3, 7) is None  # 21 values: no whole 64-value block
    # ~0.52 bytes per weight: 4-bit codes + int8 absmaxes + a scale per 256 blocks
    assert 0.51 < layout.nf4_bytes(4096, 4096, 2) / 4096**2 < 0.52


def test_qlora_trains_close_to_lora_on_an_nf4_base(tiny_model_dir, data_file, tmp_path):
    lora = run(tiny_model_dir, data_file, tmp_path / "lora", method="lora")
    qlora = run(tiny_model_dir, data_file, tmp_path / "qlora")
    # Same adapters and data; only the frozen weights differ by NF4's rounding (< 17% of
    # each 64-value block's absmax). On this near-uniform random model that moves the
    # loss by < 0.1%; 1% leaves room and still fails if the base were wrong (a zeroed or
    # unscaled base is off by > 10%).
    for got, want in zip(qlora.losses, lora.losses):
        assert got == pytest.approx(want, rel=0.01)
    assert qlora.losses[-1] < qlora.losses[0] - 0.1
    assert qlora.losses != lora.losses  # the base really was quantised


def test_the_frozen_linears_are_nf4_and_the_rest_is_not(tiny_model_dir, data_file, tmp_path):
    from keel.distributed.process_group import DistContext
    from keel.precision import Precision
    from keel.train.model_setup import build_training_model

    cfg = config(tiny_model_dir, data_file, tmp_path / "x", method="qlora")
    built = build_training_model(
        cfg, tiny_model_dir, DistContext(), Precision("fp32", "test"), quiet, strategy="single"
    )
    params = dict(built.model.named_parameters())
    nf4 = [name for name, p in params.items() if keel_nf4.is_nf4(p)]
    assert len(nf4) == 2 * 7  # q k v o gate up down in each of 2 layers
    assert all(name.endswith("base_layer.weight") for name in nf4)
    assert not any(keel_nf4.is_nf4(p) for name, p in params.items() if "lora_" in name)
    assert not keel_nf4.is_nf4(params["base_model.model.model.embed_tokens.weight"])  # = lm_head
    assert all(p.requires_grad == ("lora_" in name) for name, p in params.items())


def test_adapter_loads_in_peft_on_the_fp32_base_and_merges(tiny_model_dir, data_file, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "qlora"
    run(tiny_model_dir, data_file, out, "output.merge_lora=true")
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        with adapted.disable_adapter():
            plain = adapted(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
        got = merged(input_ids=ids).logits
        exported_dir = export_model(
            ExportRequest(model=str(out), out=tmp_path / "exported"), log=quiet
        )
        exported = AutoModelForCausalLM.from_pretrained(exported_dir, dtype=torch.float32)
        got_export = exported(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapter learned something
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_export, want, rtol=1e-4, atol=1e-5)
    # merged into full precision: no quantised tensor, the base's own dtype
    weights = load_file(out / "merged" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())


bnb = pytest.importorskip("bitsandbytes")


def test_bnb_backend_trains_close_to_lora(tiny_model_dir, data_file, tmp_path):
    lora = run(tiny_model_dir, data_file, tmp_path / "lora", method="lora")
    got = run(tiny_model_dir, data_file, tmp_path / "bnb", "method.qlora.quant_backend=bnb")
    for a, b in zip(got.losses, lora.losses):
        assert a == pytest.approx(b, rel=0.01)
    assert (tmp_path / "bnb/adapter_model.safetensors").is_file()


def test_dora_on_a_bnb_base_starts_from_it_and_trains_close_to_dora(
    tiny_model_dir, data_file, tmp_path
):
    """DoRA's magnitudes start at the norms of the 4-bit weights the matmuls use: the first
    loss is the plain 4-bit LoRA run's (B is zero either way), and training stays close to
    DoRA on the full-precision base."""
    bnb4 = ("method.qlora.quant_backend=bnb",)
    dora = run(tiny_model_dir, data_file, tmp_path / "dora", "method.lora.dora=true", method="lora")
    got = run(tiny_model_dir, data_file, tmp_path / "q", *bnb4, "method.lora.dora=true")
    plain = run(tiny_model_dir, data_file, tmp_path / "p", *bnb4, "train.max_steps=1")
    assert got.losses[0] == plain.losses[0]
    for a, b in zip(got.losses, dora.losses):
        assert a == pytest.approx(b, rel=0.01)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny Llama whose linear layers take >= 64 inputs: bitsandbytes' CPU repacking
    works in blocks of 64 input features (on the 32-wide tiny model it crashes instead)."""
    from conftest import build_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            pad_token_id=0,
        )
    )
    path = tmp_path_factory.mktemp("wide-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def eval_between_steps(model_dir, data_file, out, *overrides):
    """Training losses of a bnb QLoRA run that evaluates every 2 steps (or never)."""
    result = run(
        model_dir,
        data_file,
        out,
        "method.qlora.quant_backend=bnb",
        "train.precision=bf16",
        "data.val_size=2",
        *overrides,
    )
    return result.losses


def test_evaluating_between_steps_does_not_change_training(wide_model_dir, data_file, tmp_path):
    """bitsandbytes repacks 4-bit weights in place for its AVX512-BF16 kernel on the first
    eval-mode forward; later training forwards then read wrong weights. keel turns that
    off: a run that evaluates every 2 steps trains exactly like one that does not."""
    plain = eval_between_steps(wide_model_dir, data_file, tmp_path / "a", "train.eval_every=0")
    evaluated = eval_between_steps(wide_model_dir, data_file, tmp_path / "b", "train.eval_every=2")
    assert evaluated == plain


@pytest.mark.skipif(
    not bnb.functional.has_avx512bf16(), reason="the repacking needs an AVX512-BF16 CPU"
)
def test_negative_control_with_repacking_on_training_goes_wrong(
    wide_model_dir, data_file, tmp_path, monkeypatch
):
    import keel.quant.bnb as keel_bnb

    original = keel_bnb.quantize_on_meta

    def repacking_on(*args, **kwargs):
        names = original(*args, **kwargs)
        for _, module in args[0]:
            module.support_avx512bf16_for_cpu = True
        return names

    monkeypatch.setattr(keel_bnb, "quantize_on_meta", repacking_on)
    plain = eval_between_steps(wide_model_dir, data_file, tmp_path / "a", "train.eval_every=0")
    evaluated = eval_between_steps(wide_model_dir, data_file, tmp_path / "b", "train.eval_every=2")
    assert evaluated[:2] == plain[:2] and evaluated[2:] != plain[2:]


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (
            ["method.qlora.quant_backend=bnb", "distributed.strategy=fsdp"],
            "cannot run under distributed.strategy = fsdp",
        ),
        (["method.qlora.compute_dtype=float16"], "float16 is not supported on a CPU"),
    ],
    ids=["bnb-under-fsdp", "fp16-compute-on-cpu"],
)
def test_refused_combinations_exit_2_with_the_reason(
    tiny_model_dir, data_file, tmp_path, overrides, reason
):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps(
            {
                "model": {"path": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
                "method": {"type": "qlora"},
                "data": {"datasets": [str(data_file)]},
                "train": {"max_steps": 1, "precision": "fp32"},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    done = keel_in_process("train", str(cfg), *overrides)
    assert done.returncode == 2, done.stderr[-2000:]
    assert reason in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_missing_torchao_is_a_config_error(monkeypatch):
    import importlib

    from keel import quant

    real = importlib.import_module

    def no_torchao(name, *args):
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(quant.importlib, "import_module", no_torchao)
    with pytest.raises(ConfigError, match="method.type = qlora needs torchao"):
        keel_nf4._nf4_module()


@pytest.fixture(scope="module")
def prequantized_dir(tmp_path_factory, wide_model_dir):
    """The wide model saved 4-bit by transformers + bitsandbytes (what the Hub hosts as
    "...-bnb-4bit" checkpoints)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        wide_model_dir, quantization_config=quantization, device_map="cpu"
    )
    path = tmp_path_factory.mktemp("wide-bnb-4bit")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(wide_model_dir).save_pretrained(path)
    return path


def test_a_prequantised_bnb_checkpoint_trains_with_the_bnb_backend(
    prequantized_dir, wide_model_dir, data_file, tmp_path
):
    keys = load_file(prequantized_dir / "model.safetensors").keys()
    assert any(k.endswith("q_proj.weight.quant_state.bitsandbytes__nf4") for k in keys)
    got = run(prequantized_dir, data_file, tmp_path / "pre", "method.qlora.quant_backend=bnb")
    ours = run(wide_model_dir, data_file, tmp_path / "ours", "method.qlora.quant_backend=bnb")
    # the same NF4 codes as keel's own bnb quantisation of the same weights
    assert got.losses == pytest.approx(ours.losses, rel=1e-5)
    with pytest.raises(ModelError, match="stored 4-bit by bitsandbytes"):
        run(prequantized_dir, data_file, tmp_path / "lora", method="lora")
