"""Each process's random number generator states in a checkpoint, without pickles."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def save_rng(path: Path) -> None:
    """This process's RNG states as safetensors (torch, CUDA) with Python's in the metadata."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{index}"] = state
    version, internal, gauss = random.getstate()
    python = json.dumps({"version": version, "state": list(internal), "gauss": gauss})
    save_file(tensors, str(path), metadata={"python": python})


def load_rng(path: Path) -> dict:
    """What `save_rng` wrote: {"torch": tensor, "cuda": [tensors], "python": state tuple}."""
    with safe_open(str(path), framework="pt") as handle:
        python = json.loads(handle.metadata()["python"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
    state = (python["version"], tuple(python["state"]), python["gauss"])
    return {"torch": tensors["torch"], "cuda": cuda, "python": state}


def restore_rng(state: dict) -> None:
    """Set this process's RNGs to what `load_rng` read."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
