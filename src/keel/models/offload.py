"""Offloaded activation checkpointing: the inputs each checkpointed layer keeps for its
recompute wait in host memory between forward and backward.

Non-reentrant checkpointing (`torch.utils.checkpoint`, use_reentrant=False) saves for
backward only what the checkpointed function receives positionally — for a Hugging Face
decoder layer, the hidden states coming in (the keyword inputs such as the rotary
embeddings and the mask stay referenced by the call itself, and are shared by all layers).
Everything the layer computes is recomputed in backward. So with checkpointing on, what a
step keeps on the device between forward and backward is `layers x tokens x hidden`, and
wrapping each layer's checkpoint call in `saved_tensors_hooks` that copy those tensors to
(pinned) host memory frees it, at the price of one device-to-host copy per layer in forward
and one host-to-device copy in backward (Unsloth's "offloaded gradient checkpointing").

The hooks are per layer and local, so they compose with DDP and FSDP2 (whose module hooks
run outside the checkpointed forward). No torch.distributed here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


class HostOffload:
    """saved_tensors_hooks pack/unpack that keep saved tensors on `host` until backward.

    pack copies a saved tensor into a fresh `host` tensor (pinned when `pin_memory`, so the
    copies are asynchronous on the compute stream) and remembers the device it came from;
    unpack copies it back there. Every packed tensor is copied, even one already on `host`,
    so the hooks do real work on any device (a CPU-only run does not install them: there the
    host memory is the device memory).
    """

    def __init__(self, host: torch.device | str = "cpu", *, pin_memory: bool = False):
        self.host = torch.device(host)
        self.pin_memory = pin_memory

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        packed = torch.empty_like(tensor, device=self.host, pin_memory=self.pin_memory)
        packed.copy_(tensor, non_blocking=self.pin_memory)
        return tensor.device, packed

    def unpack(self, saved: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, packed = saved
        return packed.to(device, non_blocking=self.pin_memory)

    def wrap(self, checkpoint_fn: Callable) -> Callable:
        """`checkpoint_fn` (a layer's checkpoint call) with what it saves kept on the host."""

        @functools.wraps(checkpoint_fn)
        def checkpoint_offloaded(function, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return checkpoint_fn(function, *args, **kwargs)

        return checkpoint_offloaded


def offload_for(device: torch.device) -> HostOffload | None:
    """The offload for a run on `device`; None on a CPU, where host memory is device memory
    (offloading there would only copy tensors within the same memory)."""
    if device.type == "cpu":
        return None
    return HostOffload("cpu", pin_memory=device.type == "cuda")


def offload_checkpointed_inputs(model: nn.Module, offload: HostOffload) -> int:
    """Route the saved inputs of every checkpointed layer of `model` through `offload`.

    Call after checkpointing is enabled (`keel.models.loading.enable_activation_checkpointing`);
    wraps the checkpoint function transformers gave each layer. Returns how many layers
    offload (0 when none checkpoints).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    wrapped = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module._gradient_checkpointing_func = offload.wrap(module._gradient_checkpointing_func)
            wrapped += 1
    return wrapped


def offload_activations(model: nn.Module, device: torch.device, log) -> None:
    """train.gradient_checkpointing = offload on `model` (checkpointing already enabled)."""
    offload = offload_for(device)
    if offload is None:
        log(
            "activation offload: on a CPU the host memory is the device memory, so "
            "train.gradient_checkpointing=offload is plain checkpointing here"
        )
        return
    layers = offload_checkpointed_inputs(model, offload)
    log(
        f"activation offload: the saved inputs of {layers} checkpointed layers wait in "
        f"{'pinned ' if offload.pin_memory else ''}host memory until backward"
    )
