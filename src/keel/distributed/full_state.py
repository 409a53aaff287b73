"""A module's full (unsharded) weights, gathered onto rank 0 to write the final model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def gather_full_state(
    module: nn.Module, *, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The weights of `module` as full CPU tensors on rank 0 ({} elsewhere; collective).

    trainable_only: skip frozen weights (an adapter save needs only the adapter, and
    gathering a frozen base would put a whole model in rank 0's memory for nothing).
    """
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
    )
    return get_model_state_dict(module, options=options)
