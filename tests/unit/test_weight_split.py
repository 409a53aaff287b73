"""method.lora.init: pissa and olora (and gaussian): adapters that start as a part of each
weight, as PEFT starts them; a run's saved adapter is a plain LoRA on the original base."""

from __future__ import annotations

import json

import pytest
import torch
from test_distributed_units import fill_second_halves
from test_train_run import config, quiet

from keel.config.schema import LoraConfig, MethodConfig
from keel.errors import ConfigError
from keel.models.materialize import (
    Starts,
    allocate,
    build_empty_model,
    fill_weights,
    init_computed_buffers,
)

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])


def _on_meta(model_dir, **lora):
    from keel.models import apply_method

    model = build_empty_model(model_dir, dtype=torch.float32)
    method = MethodConfig(
        type="lora", lora=LoraConfig(**{"r": 4, "alpha": 8, "dropout": 0.0} | lora)
    )
    with torch.device("meta"):
        return apply_method(model, method, log=lambda _m: None)


def _filled(model_dir, init: str, iters: int = 0):
    model = _on_meta(model_dir, init=init, pissa_iters=iters)
    allocate(model, torch.device("cpu"))
    init_computed_buffers(model.get_base_model())
    starts = Starts(seed=0, lora_init=init, pissa_iters=iters)
    fill_weights(model, model_dir, starts, region_of=lambda p: None, local=lambda p: p)
    return model


def _loras(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}


@pytest.mark.parametrize(("init", "iters"), [("pissa", 0), ("pissa", 4), ("olora", 0)])
def test_a_split_start_is_the_base_model(tiny_model_dir, init, iters):
    """W_res + s B A is the base weight, so the logits are the base's; with the exact SVD
    (pissa, iters 0) and with QR (olora), B A and W_res are PEFT's own
    init_lora_weights="pissa" / "olora" ones."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from keel.models import load_model

    base = load_model(tiny_model_dir, dtype=torch.float32)
    model = _filled(tiny_model_dir, init, iters)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=IDS).logits, base(input_ids=IDS).logits, rtol=1e-4, atol=1e-5
        )
    ours = _loras(model)
    assert len(ours) == 14  # every linear of the 2 decoder layers
    for module in ours.values():  # the adapter is not zero: it holds the principal part
        assert module.lora_B["default"].weight.abs().max() > 1e-3
    if iters:
        return
    peft = get_peft_model(
        load_model(tiny_model_dir, dtype=torch.float32),
        PeftLora(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=init),
    )
    theirs = _loras(peft)
    assert theirs.keys() == ours.keys()
    for name, module in ours.items():
        other = theirs[name]
        product = module.lora_B["default"].weight @ module.lora_A["default"].weight
        want = other.lora_B["default"].weight @ other.lora_A["default"].weight
        torch.testing.assert_close(product, want, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(
            module.base_layer.weight, other.base_layer.weight, rtol=1e-4, atol=1e-5, msg=name
        )


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_shard_holds_its_rows_of_the_whole_decomposition(tiny_model_dir, init):
    """FSDP2: each process decomposes the whole weight it reads and keeps its rows of W_res,
    A and B; the second half of each equals one process's (the factors' signs fixed, so
    both agree)."""
    whole = dict(_filled(tiny_model_dir, init).named_parameters())
    model = _on_meta(tiny_model_dir, init=init, pissa_iters=0)
    starts = Starts(seed=0, lora_init=init, pissa_iters=0)
    halves = fill_second_halves(model, tiny_model_dir, starts)
    checked = 0
    for name, half in halves.items():
        if ".lora_" in name or ".base_layer." in name:
            torch.testing.assert_close(half, whole[name][-half.shape[0] :], msg=name)
            checked += 1
    assert checked == 14 * 3


def test_gaussian_draws_a_from_a_normal_of_std_one_over_r(tiny_model_dir):
    model = _on_meta(tiny_model_dir, r=8, init="gaussian")
    allocate(model, torch.device("cpu"))
    starts = Starts(seed=0, lora_init="gaussian")
    fill_weights(model, tiny_model_dir, starts, region_of=lambda p: None, local=lambda p: p)
    a = torch.cat([m.lora_A["default"].weight.flatten() for m in _loras(model).values()])
    assert a.std().item() == pytest.approx(1 / 8, rel=0.05)
    assert a.abs().max() > 2 / 8  # not kaiming-uniform's bound 1/sqrt(64)
    assert all(m.lora_B["default"].weight.abs().max() == 0 for m in _loras(model).values())


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_split_run_saves_a_lora_that_applies_to_the_original_base(
    tiny_model_dir, data_file, tmp_path, init
):
    """After training, the saved adapter (rank 2r: [A; A0], [B, -B0]) on the unchanged
    base gives the merged model's logits. Negative control: the trained A and B alone, as
    PEFT would save them without the conversion, do not."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    from keel.models import load_model
    from keel.train.run import run_training

    out = tmp_path / init
    overrides = (f"method.lora.init={init}", "method.lora.dropout=0", "output.merge_lora=true")
    run_training(config(tiny_model_dir, data_file, out, *overrides), log=quiet)
    adapter = out  # the output folder is the adapter; merged/ beside it
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["init_lora_weights"]) == (8, 16, True)
    merged = load_model(out / "merged", dtype=torch.float32)
    on_base = PeftModel.from_pretrained(load_model(tiny_model_dir, dtype=torch.float32), adapter)
    with torch.no_grad():
        want = merged(input_ids=IDS).logits
        torch.testing.assert_close(on_base(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-5)
        base = load_model(tiny_model_dir, dtype=torch.float32)(input_ids=IDS).logits
    assert (want - base).abs().max() > 1e-3  # it trained
    # negative control: the rank-r halves (the trained A, B) on the unchanged base
    unconverted = tmp_path / "unconverted"
    unconverted.mkdir()
    weights = load_file(adapter / "adapter_model.safetensors")
    halves = {k: (v[:4] if ".lora_A." in k else v[:, :4]).contiguous() for k, v in weights.items()}
    save_file(halves, unconverted / "adapter_model.safetensors")
    config_file = unconverted / "adapter_config.json"
    config_file.write_text(json.dumps(saved | {"r": 4, "lora_alpha": 8}))
    wrong = PeftModel.from_pretrained(load_model(tiny_model_dir, dtype=torch.float32), unconverted)
    with torch.no_grad():
        assert (wrong(input_ids=IDS).logits - want).abs().max() > 1e-2


def test_a_resumed_pissa_run_trains_as_the_uninterrupted_one(tiny_model_dir, data_file, tmp_path):
    """The resumed run decomposes the base again and loads the trained A and B: the same
    losses and the same saved adapter."""
    from safetensors.torch import load_file

    from keel.train.run import run_training

    pissa = ("method.lora.init=pissa", "method.lora.dropout=0", "train.scheduler=constant")
    whole = run_training(config(tiny_model_dir, data_file, tmp_path / "whole", *pissa), log=quiet)
    stopped = tmp_path / "stopped"
    run_training(config(tiny_model_dir, data_file, stopped, *pissa, "train.max_steps=4"), log=quiet)
    lines: list[str] = []
    resumed = run_training(config(tiny_model_dir, data_file, stopped, *pissa), log=lines.append)
    assert any(line.startswith("resumed from") for line in lines)
    assert resumed.losses == pytest.approx(whole.losses[4:], rel=1e-6)
    got = load_file(stopped / "adapter_model.safetensors")
    want = load_file(tmp_path / "whole" / "adapter_model.safetensors")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_reference_model_under_a_split_start_is_a_frozen_copy_of_the_base(
    tiny_model_dir, data_file, tmp_path
):
    """The base with the adapter off is W_res, not the model the run started from."""
    from keel.train.model_setup import reference_source_of

    dpo = ("train.stage=dpo",)
    assert reference_source_of(config(tiny_model_dir, data_file, tmp_path, *dpo)) == "adapters"
    for init in ("pissa", "olora"):
        cfg = config(tiny_model_dir, data_file, tmp_path, *dpo, f"method.lora.init={init}")
        assert reference_source_of(cfg) == "copy"
    cfg = config(tiny_model_dir, data_file, tmp_path, *dpo, "method.lora.init=gaussian")
    assert reference_source_of(cfg) == "adapters"


@pytest.mark.parametrize(
    ("overrides", "method", "said"),
    [
        ((), "qlora", "method.lora.init = pissa with method.type = qlora"),
        (("method.lora.dora=true",), "lora", "with method.lora.dora: DoRA's magnitudes"),
        (("method.lora.init=olora",), "qlora", "method.lora.init = olora with method.type"),
        (("method.lora.pissa_iters=-1",), "lora", "method.lora.pissa_iters = -1 must be >= 0"),
    ],
)
def test_what_pissa_cannot_hold_is_refused(
    tiny_model_dir, data_file, tmp_path, overrides, method, said
):
    with pytest.raises(ConfigError, match=said):
        config(
            tiny_model_dir, data_file, tmp_path, "method.lora.init=pissa", *overrides,
            method=method,
        )  # fmt: skip


def test_dpo_under_pissa_starts_at_log_2(tiny_model_dir, tmp_path):
    """At the first step the policy is the model the run started from, and so is its
    reference (a frozen copy of the base): every margin is 0, the loss ln 2. The base with
    the adapter off (W_res) would score otherwise."""
    import math

    from keel.train.run import run_training

    pairs = [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No {i * 7}."}
        for i in range(8)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "dpo"
    overrides = (
        "train.stage=dpo", "method.lora.init=pissa", "method.lora.dropout=0",
        "train.max_steps=1", "data.val_size=0", "output.save_every=0",
    )  # fmt: skip
    run_training(config(tiny_model_dir, data, out, *overrides), log=quiet)
    (first,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)


def test_a_split_start_on_an_output_layer_tied_to_the_embeddings_is_refused(tiny_model_dir):
    """Splitting the tiny Llama's lm_head (tied) would change its input embeddings too."""
    from keel.models.adapters import method_problems

    model = build_empty_model(tiny_model_dir, dtype=torch.float32)
    for init, refused in (("pissa", True), ("olora", True), ("default", False)):
        lora = LoraConfig(init=init, targets=["q_proj", "lm_head"])
        problems = method_problems(model, MethodConfig(type="lora", lora=lora))
        assert bool(problems) == refused, problems
        if refused:
            assert "lm_head in method.lora.targets: its weight is the input" in problems[0]
    untargeted = LoraConfig(init="pissa", targets=["q_proj"])
    assert method_problems(model, MethodConfig(type="lora", lora=untargeted)) == []
