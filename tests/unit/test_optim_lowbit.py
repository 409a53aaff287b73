"""train.optimizer adamw_8bit / adamw_4bit: torchao's AdamW8bit / AdamW4bit through keel.

Runs use a random 2-layer Llama of the shared tiny decoder shape (hidden 64), so that most
weights (>= 4096 values) have quantised moments; the tiny test Llama (hidden 32) would
quantise only its embeddings. The first 8/4-bit step compiles the update (~15-30 s on a
2-core CPU when inductor's on-disk cache is cold, 1-3 s warm); every run here has the same
shapes, so one pytest process compiles each variant once.
"""

import json
import shutil

import pytest
import torch
from conftest import TINY_DECODER, build_tiny_tokenizer
from safetensors.torch import load_file
from torch import nn

import keel.checkpoint.checkpointer as checkpointer
import keel.quant
from keel.config import TrainConfig, load_config
from keel.errors import ConfigError
from keel.quant.optim_state import LOW_BIT
from keel.train.optim import build_optimizer
from keel.train.preflight import preflight
from keel.train.run import run_training

ROWS = [{"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(8)]
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # never touched: only the device type is read


def quiet(_msg):
    pass


def save_lowbit_llama(path):
    """The tiny decoder shape as a tied Llama with the tiny tokenizer, saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **TINY_DECODER,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowbit")
    data = root / "qa.json"
    data.write_text(json.dumps(ROWS))
    base = {
        "model": {"path": str(save_lowbit_llama(root / "model")), "cache_dir": str(root / "cache")},
        "method": {"type": "full"},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "train": {
            "max_steps": 6,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "precision": "fp32",
            "threads": 1,
            "scheduler": "constant",
        },
        "output": {"dir": "unused", "save_every": 2},
    }
    return root, base


def train(workspace, out: str, *overrides: str, log=quiet):
    root, base = workspace
    cfg = load_config(None, [f"output.dir={root / out}", *overrides], base=base)
    return run_training(cfg, log=log)


@pytest.fixture(scope="module")
def uninterrupted(workspace):
    """6-step runs, one per optimizer, shared by the tests that compare with them."""
    runs = {}

    def run(optimizer: str):
        if optimizer not in runs:
            runs[optimizer] = train(workspace, optimizer, f"train.optimizer={optimizer}")
        return runs[optimizer]

    return run


@pytest.mark.parametrize("choice", ["adamw", "adamw_8bit", "adamw_4bit"])
def test_build_optimizer_picks_the_class_groups_and_hyperparameters(choice):
    torchao_optim = keel.quant.import_torchao("optim", needed_for="this test")
    model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
    model[1].weight.requires_grad_(False)
    cfg = TrainConfig(
        lr=3e-3, weight_decay=0.1, adam_betas=[0.8, 0.95], adam_eps=1e-6, optimizer=choice
    )
    optimizer = build_optimizer(model, cfg)
    want = {
        "adamw": torch.optim.AdamW,
        "adamw_8bit": torchao_optim.AdamW8bit,
        "adamw_4bit": torchao_optim.AdamW4bit,
    }[choice]
    assert type(optimizer) is want
    decay, no_decay = optimizer.param_groups
    assert list(map(id, decay["params"])) == [id(model[0].weight)]
    assert decay["weight_decay"] == 0.1
    # the frozen norm weight is left out
    assert list(map(id, no_decay["params"])) == [id(model[0].bias), id(model[1].bias)]
    assert no_decay["weight_decay"] == 0.0
    for group in optimizer.param_groups:
        assert float(group["lr"]) == pytest.approx(3e-3)  # a tensor in torchao's
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6
        assert not group["amsgrad"]
    if choice != "adamw":
        assert optimizer.block_size == LOW_BIT[choice].block_size  # torchao's default
        assert optimizer.is_adamw and not optimizer.bf16_stochastic_round


# Per-step relative difference from fp32 AdamW's loss over 6 steps (measured: 8-bit
# <= 2.4e-4, 4-bit <= 5.0e-2, growing with the steps). 8-bit dynamic-map codes carry a
# small relative error per moment; 4-bit exp_avg_sq uses a linear map of 16 levels without
# zero, so small second moments round up to 1/16 of their block's largest, shrinking
# those elements' updates: the loss lags fp32's by a few percent.
@pytest.mark.parametrize("choice,rel", [("adamw_8bit", 1e-3), ("adamw_4bit", 0.1)])
def test_low_bit_training_stays_close_to_adamw(uninterrupted, choice, rel):
    want = uninterrupted("adamw").losses
    got = uninterrupted(choice).losses
    assert len(got) == len(want) == 6
    assert got[-1] < 0.6 * got[0]  # it trains: 5.84 -> 3.01 (8-bit), 3.16 (4-bit)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rel * b, (step, a, b)
    # Not fp32 AdamW under another name: the moments really were quantised.
    assert got != want


def resumed_losses(workspace, out: str) -> dict[int, float]:
    root, _ = workspace
    records = map(json.loads, (root / out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resume_with_8bit_state_continues_exactly(workspace, uninterrupted, monkeypatch):
    """Stop after the step-4 checkpoint, resume to step 6: the same losses and weights as
    the uninterrupted run, bit for bit. Negative control: the same resume with the loaded
    optimizer state dropped (torchao starts its moments over) gives other losses."""
    root, _ = workspace
    want = uninterrupted("adamw_8bit")
    train(workspace, "stopped", "train.optimizer=adamw_8bit", "train.max_steps=4")
    shutil.copytree(root / "stopped", root / "dropped")

    real_load, loaded = checkpointer.load_sharded, []

    def spy(path, module, optimizer):
        real_load(path, module, optimizer)
        loaded.extend(type(v).__name__ for s in optimizer.state.values() for v in s.values())

    monkeypatch.setattr(checkpointer, "load_sharded", spy)
    lines = []
    got = train(workspace, "stopped", "train.optimizer=adamw_8bit", log=lines.append)
    assert any(line.startswith("resumed from") and "step-00000004" in line for line in lines)
    assert "OptimState8bit" in loaded  # quantised moments went through the checkpoint
    assert got.losses == want.losses[4:]
    assert resumed_losses(workspace, "stopped") == resumed_losses(workspace, "adamw_8bit")
    weights = load_file(root / "stopped/model.safetensors")
    reference = load_file(root / "adamw_8bit/model.safetensors")
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)

    def drop(path, module, optimizer):
        real_load(path, module, optimizer)
        optimizer.state.clear()

    monkeypatch.setattr(checkpointer, "load_sharded", drop)
    dropped = train(workspace, "dropped", "train.optimizer=adamw_8bit")
    assert len(dropped.losses) == 2 and dropped.losses[0] == want.losses[4]  # same weights
    assert dropped.losses[1] != want.losses[5]  # ... but moments started over


def checked(workspace, *overrides, device=CPU):
    """keel.train.preflight of the workspace's config with `overrides`."""
    root, base = workspace
    cfg = load_config(None, [f"output.dir={root / 'never'}", *overrides], base=base)
    return preflight(cfg, base_dir=root, log=quiet, device=device, source="run.yaml")


def preflight_problems(workspace, *overrides, device=CPU) -> list[str]:
    with pytest.raises(ConfigError) as info:
        checked(workspace, *overrides, device=device)
    return info.value.problems


@pytest.mark.parametrize(
    "device,looked_for", [(CPU, "g++"), (CUDA, "gcc or clang")], ids=["cpu", "cuda"]
)
def test_a_missing_compiler_is_refused_before_training(workspace, monkeypatch, device, looked_for):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    problems = preflight_problems(workspace, "train.optimizer=adamw_4bit", device=device)
    assert len(problems) == 1, problems
    assert problems[0].startswith("train.optimizer = adamw_4bit compiles its update")
    assert f"none of {looked_for} was found" in problems[0]
    assert "or use train.optimizer=adamw" in problems[0]
    # Negative control: plain AdamW compiles nothing, so the same machine is fine for it.
    assert checked(workspace, "train.optimizer=adamw", device=device).model is not None


def test_a_missing_torchao_is_a_config_error(workspace, monkeypatch):
    real_import = keel.quant.importlib.import_module

    def no_torchao(name, *args):
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(keel.quant.importlib, "import_module", no_torchao)
    cfg = TrainConfig(optimizer="adamw_8bit")
    with pytest.raises(ConfigError) as info:
        build_optimizer(nn.Linear(2, 2), cfg)
    message = str(info.value)
    assert "train.optimizer = adamw_8bit needs torchao" in message
    assert "pip install 'torchao>=0.18'" in message
    assert isinstance(build_optimizer(nn.Linear(2, 2), TrainConfig()), torch.optim.AdamW)
    problems = preflight_problems(workspace, "train.optimizer=adamw_8bit")
    assert [p for p in problems if "needs torchao" in p], problems
