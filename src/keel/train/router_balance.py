"""A mixture of experts' load-balancing loss (train.router_aux_loss_coef).

transformers adds it to the loss when a model's config sets `output_router_logits`: the
coefficient times the Switch Transformer loss over every MoE layer's router logits (the
model's own `load_balancing_loss_func`), once per forward. keel's loss is a sum over
target tokens that the trainer divides by the step's count; the term enters as coefficient
x aux x the micro-batch's target tokens, so a step of one micro-batch adds exactly
coefficient x aux, as transformers does, and a step of several weighs each micro-batch by
its tokens, as their cross-entropy is weighed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from keel.errors import ModelError


@dataclass(frozen=True)
class RouterBalance:
    coefficient: float
    loss_of: Callable  # the model's load_balancing_loss_func(logits, experts, top_k, mask)
    experts: int
    per_token: int  # experts each token goes through (top-k)

    @classmethod
    def of(cls, lm: nn.Module, setting: float | str) -> RouterBalance | None:
        """The balance term for the causal LM `lm` (not a PEFT wrapper), None when the
        setting is 0; "model" takes the config's router_aux_loss_coef."""
        if setting == 0:
            return None
        module = sys.modules.get(type(lm).__module__)
        loss_of = getattr(module, "load_balancing_loss_func", None)
        experts = getattr(lm, "num_experts", None)
        per_token = getattr(lm, "num_experts_per_tok", None)
        if loss_of is None or not experts or not per_token:
            raise ModelError(
                f"train.router_aux_loss_coef = {setting}: {type(lm).__name__} has no router "
                f"whose load-balancing loss transformers computes (not a mixture of experts, "
                f"or one keel does not know); set it to 0"
            )
        coefficient = getattr(lm, "router_aux_loss_coef", None) if setting == "model" else setting
        if coefficient is None:
            raise ModelError(
                f"train.router_aux_loss_coef = model: {type(lm).__name__}'s config has no "
                f"router_aux_loss_coef; give the coefficient (e.g. 0.001)"
            )
        return cls(float(coefficient), loss_of, int(experts), int(per_token))

    def loss(self, router_logits, batch: dict) -> torch.Tensor:
        """The auxiliary loss of one forward's router logits (one [tokens, experts] tensor
        per MoE layer); padding (right-padded rows: batch["row_lengths"]) left out."""
        mask = None
        lengths = batch.get("row_lengths")
        if lengths is not None:
            width = batch["input_ids"].shape[1]
            positions = torch.arange(width, device=lengths.device)  # [T]
            mask = (positions[None] < lengths[:, None]).long()  # [B, T]
        return self.loss_of(tuple(router_logits), self.experts, self.per_token, mask)
