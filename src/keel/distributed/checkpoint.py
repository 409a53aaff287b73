"""Sharded training state with torch.distributed.checkpoint (DCP).

Each process writes only what it holds (its FSDP2 shards; DDP replicas are de-duplicated),
and loading reshards: a state saved by 2 processes loads into 1, and 1 into 2. Frozen
parameters are left out: they are reloaded from the base model, so a LoRA checkpoint
stays adapter-sized.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def save_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the trainable weights and optimizer state of `module` under `path` (collective)."""
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    with _single_process_is_intended():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path),
                 no_dist=not _distributed())


def load_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_sharded` wrote into `module` and `optimizer`, resharding as needed."""
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optimizer": optim_state}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    # Not strict: frozen parameters are absent by design. A trainable one must not be.
    result = set_state_dict(module, optimizer, model_state_dict=state["model"],
                            optim_state_dict=state["optimizer"],
                            options=StateDictOptions(ignore_frozen_params=True, strict=False))
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    missing = [k for k in result.missing_keys if _strip_wrapper(k) in trainable]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {path} does not match this model: missing trainable "
                         f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}")


@contextmanager
def _single_process_is_intended():
    """DCP warns on every single-process save/load, even when asked for one (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _strip_wrapper(name: str) -> str:
    return name.removeprefix("module.")


def gather_full_state(module: nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The weights of `module` as full CPU tensors on rank 0 ({} elsewhere; collective).

    trainable_only: skip frozen weights (an adapter save needs only the adapter, and
    gathering a frozen base would put a whole model in rank 0's memory for nothing).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                               ignore_frozen_params=trainable_only)
    return get_model_state_dict(module, options=options)
