"""A saved PEFT adapter's tensors (model.adapter), by the live parameter each one fills."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from keel.errors import ModelError
from keel.models.checkpoint_reader import CheckpointReader

DORA_MAGNITUDE = ".lora_magnitude_vector."  # PEFT's name for a DoRA layer's magnitude


class AdapterWeights:
    """A saved PEFT adapter's tensors (model.adapter), by the live parameter they fill."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.reader = CheckpointReader(folder)
        self.used: set[str] = set()

    def fill(self, name: str, tensor: torch.Tensor, region_of, local) -> bool:
        """Fill parameter `name` from the adapter when it is an adapter weight (False: a
        base weight, for the model's checkpoint); ModelError when the adapter lacks it."""
        key = self.key_of(name)
        if key is None:
            return False
        stored = self.reader.shape(key)
        if stored is None or stored != tuple(tensor.shape):
            found = "holds no" if stored is None else f"holds shape {stored} for"
            raise ModelError(
                f"model.adapter {self.folder} {found} {key} (this model's is "
                f"{tuple(tensor.shape)}); was the adapter trained on this model, with these "
                f"targets? (method.lora or method.oft follows its adapter_config.json)"
            )
        local(tensor).copy_(self.reader.get(key, region_of(tensor)))
        self.used.add(key)
        return True

    @staticmethod
    def key_of(name: str) -> str | None:
        """The adapter file's key of live parameter `name`; None for a base weight. PEFT
        saves without the adapter's name: lora_A.default.weight -> lora_A.weight (OFT's
        oft_R.default.weight -> oft_R.weight),
        lm_head.modules_to_save.default.weight -> lm_head.weight, and a DoRA magnitude
        without its parameter's name: lora_magnitude_vector.default.weight ->
        lora_magnitude_vector."""
        adapter = ".lora_" in name or ".oft_R." in name or ".modules_to_save.default." in name
        if not adapter:
            return None
        name = name.replace(f"{DORA_MAGNITUDE}default.weight", DORA_MAGNITUDE.rstrip("."))
        return name.replace(".modules_to_save.default.", ".").replace(".default.", ".")

    def check_all_used(self, model: nn.Module) -> None:
        """Every tensor of the adapter found its place (none belongs to another model); a
        tied twin (PEFT saves the output layer's copy beside the embeddings') has one."""
        names = (n for n, _ in model.named_parameters(remove_duplicate=False))
        places = {self.key_of(n) for n in names} - {None}
        unused = sorted(set(self.reader.keys()) - self.used - places)
        if unused:
            raise ModelError(
                f"model.adapter {self.folder} holds {len(unused)} tensor(s) this model has no "
                f"place for, e.g. {unused[0]}; was it trained on another model?"
            )
