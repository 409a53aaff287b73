"""keel.models.offload: checkpointed layers whose saved inputs wait in host memory.

On a CPU the hooks are forced to copy (HostOffload copies every tensor it packs), so the
comparison with plain checkpointing exercises the real pack -> host -> unpack path.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model

from keel.models.loading import enable_activation_checkpointing
from keel.models.offload import HostOffload, offload_checkpointed_inputs, offload_for

VOCAB = 97
LAYERS = 3


class Counting(HostOffload):
    """Counts what it packs (and can corrupt what it unpacks: the negative control)."""

    def __init__(self, corrupt: bool = False):
        super().__init__("cpu")
        self.packed: list[tuple[int, ...]] = []
        self.corrupt = corrupt

    def pack(self, tensor):
        self.packed.append(tuple(tensor.shape))
        device, packed = super().pack(tensor)
        assert packed.data_ptr() != tensor.data_ptr()  # a real copy
        return device, packed

    def unpack(self, saved):
        tensor = super().unpack(saved)
        return tensor * 1.001 if self.corrupt else tensor


def _loss_and_grads(offload: HostOffload | None):
    model = build_tiny_model(VOCAB, seed=3, layers=LAYERS)
    model.train()
    enable_activation_checkpointing(model)
    if offload is not None:
        assert offload_checkpointed_inputs(model, offload) == LAYERS
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_offloaded_checkpointing_gives_the_same_loss_and_gradients():
    loss, grads = _loss_and_grads(None)
    offload = Counting()
    loss_off, grads_off = _loss_and_grads(offload)
    assert torch.equal(loss, loss_off)  # bit-identical: the recompute sees an exact copy
    assert grads.keys() == grads_off.keys()
    assert all(torch.equal(grads[n], grads_off[n]) for n in grads)
    # What each checkpointed layer saves outside its recompute is its input alone: the
    # hidden states [B, T, hidden], one tensor per layer (not the layer's intermediates).
    assert offload.packed == [(2, 11, 32)] * LAYERS


def test_a_corrupted_unpack_changes_the_gradients():
    """Negative control: the comparison above can fail, and the unpacked inputs are what
    the recompute uses."""
    loss, grads = _loss_and_grads(None)
    loss_bad, grads_bad = _loss_and_grads(Counting(corrupt=True))
    assert torch.equal(loss, loss_bad)  # the forward does not read the saved copies
    assert not all(torch.equal(grads[n], grads_bad[n]) for n in grads)


def test_no_offload_without_checkpointing_or_in_eval():
    model = build_tiny_model(VOCAB, layers=2)
    offload = Counting()
    assert offload_checkpointed_inputs(model, offload) == 0  # checkpointing is off
    enable_activation_checkpointing(model)
    offload_checkpointed_inputs(model, offload)
    model.eval()
    ids = torch.randint(0, VOCAB, (1, 5))
    model(input_ids=ids, labels=ids).loss.backward()
    assert offload.packed == []  # transformers checkpoints in train mode only


def test_offload_is_plain_checkpointing_on_a_cpu():
    assert offload_for(torch.device("cpu")) is None
    cuda = offload_for(torch.device("cuda", 0))
    assert cuda is not None and cuda.pin_memory and cuda.host == torch.device("cpu")


def test_keel_train_runs_with_offload(tiny_model_dir, tmp_path):
    from keel.config import load_config
    from keel.train.run import run_training

    data = tmp_path / "qa.json"
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(8)]
    data.write_text(json.dumps(rows))
    base = {
        "model": {"path": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8}},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "precision": "fp32", "threads": 1},
        "output": {"dir": str(tmp_path / "out")},
    }
    runs = {}
    for mode in (True, "offload"):
        cfg = load_config(None, [f"output.dir={tmp_path / str(mode)}"], base=base)
        cfg.train.gradient_checkpointing = mode
        lines = []
        runs[mode] = run_training(cfg, log=lines.append).losses
    assert any("plain checkpointing here" in line for line in lines)
    assert runs["offload"] == pytest.approx(runs[True], rel=0, abs=0)


def test_config_accepts_offload(tiny_model_dir, tmp_path):
    from keel.config import load_config
    from keel.errors import ConfigError

    base = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"datasets": ["d.json"]},
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        load_config(None, ["train.gradient_checkpointing=offlaod"], base=base)
    cfg = load_config(None, ["train.gradient_checkpointing=offload"], base=base)
    assert cfg.train.gradient_checkpointing == "offload"
    cfg = load_config(None, ["train.gradient_checkpointing=true"], base=base)
    assert cfg.train.gradient_checkpointing is True
