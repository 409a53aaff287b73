"""Models and adapters for the `keel serve` tests (built from configs, nothing downloaded)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch


def varied_tiny_model(vocab_size: int, seed: int = 0):
    """conftest's tiny random Llama with larger weights, so greedy replies vary from token
    to token (at the usual 0.02 it repeats one token forever, which cannot tell a right
    batched answer from a wrong one)."""
    from conftest import build_tiny_model

    model = build_tiny_model(vocab_size, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:  # embeddings and projections; norms stay at 1
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return model.eval()


def random_lora(
    base, out_dir: Path, *, seed: int, targets=("q_proj", "v_proj"), dora: bool = False
) -> Path:
    """Save a PEFT LoRA adapter for `base` with random, non-zero A and B (not trained).

    PEFT's init_lora_weights=False draws B at random too, so the adapter changes answers.
    `base` is left as it was (the adapter is built on a copy). `dora`: a DoRA adapter, its
    magnitudes moved off the weights' norms too.
    """
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=list(targets), init_lora_weights=False, use_dora=dora
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.2 * torch.rand(param.shape))
    peft_model.save_pretrained(out_dir)
    return out_dir


def write_model_dir(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_server_state(tokenizer, root: Path, **options):
    """A `ServeState` over a varied tiny model saved under `root`, with adapter `lora`.

    Returns (state, model_dir, lora_dir); `options` go to ServeOptions.
    """
    from keel.infer.serve.server import ServeOptions, build_state

    model = varied_tiny_model(len(tokenizer))
    model_dir = write_model_dir(model, tokenizer, root / "model")
    lora_dir = random_lora(model, root / "lora", seed=1)
    options = ServeOptions(model=str(model_dir), adapters=(f"lora={lora_dir}",), **options)
    return build_state(options, log=lambda message: None), model_dir, lora_dir


class Paused:
    """Holds the scheduler thread between two steps (through its public `call`), so
    requests stay in flight for as long as a test needs."""

    def __init__(self, engine):
        self.engine = engine
        self.gate = threading.Event()
        self.holding = threading.Event()

    def __enter__(self):
        def hold():
            self.holding.set()
            self.gate.wait(timeout=30)

        self.engine.call(hold)
        assert self.holding.wait(timeout=10)
        return self

    def __exit__(self, *exc):
        self.gate.set()
