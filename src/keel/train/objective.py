"""How a batch becomes a loss. Stages differ only here; the loop is shared.

`CausalLMObjective` is an nn.Module so that a data-parallel wrapper can wrap it whole: the
forward it runs (decoder -> selected hidden states -> chunked output layer + CE) is the one
that gets synchronised, not the Hugging Face forward we bypass.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.losses import IGNORE_INDEX, chunked_cross_entropy, cross_entropy_sum


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The Hugging Face *ForCausalLM module inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _head_is_plain(lm: nn.Module) -> bool:
    """True when logits are exactly output_embeddings(hidden): no soft-capping or scaling."""
    config = getattr(lm, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            return False
    return isinstance(lm.get_output_embeddings(), nn.Module) and hasattr(lm, "get_decoder")


class CausalLMObjective(nn.Module):
    """Next-token cross-entropy summed over target tokens (pt and sft).

    forward(batch) -> (loss_sum, num_targets). Logits are only computed at positions that
    have a target (prompt and padding positions are skipped) and in chunks, so the
    [B, T, V] logits tensor never exists. Models whose head is not a plain projection fall
    back to the full Hugging Face forward.
    """

    def __init__(self, model: nn.Module, *, chunk_size: int = 1024):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.fast_head = _head_is_plain(causal_lm_of(model))

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        targets = batch["targets"]  # [B, T], pre-shifted
        mask = targets != IGNORE_INDEX  # [B, T]
        # No attention mask and no cache: right padding is invisible to real tokens under
        # causal attention, and packed samples are separated by their restarting position ids.
        inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      use_cache=False)
        num_targets = mask.sum()
        lm = causal_lm_of(self.model)
        if not self.fast_head:
            logits = self.model(**inputs).logits  # [B, T, V]
            return cross_entropy_sum(logits, targets), num_targets
        hidden = lm.get_decoder()(**inputs).last_hidden_state  # [B, T, H]
        selected = hidden[mask]  # [N, H]
        loss = chunked_cross_entropy(selected, targets[mask], lm.get_output_embeddings(),
                                     chunk_size=self.chunk_size)
        return loss, num_targets
