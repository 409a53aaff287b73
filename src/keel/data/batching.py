"""Epoch order and collation of prepared rows into tensors."""

from __future__ import annotations

import torch

from keel.data.encode import IGNORE_INDEX


def epoch_order(num_rows: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Row order for one epoch: a permutation from a torch.Generator seeded with seed + epoch,
    or 0..num_rows-1 when not shuffling. Same arguments, same order, on every rank."""
    if not shuffle:
        return list(range(num_rows))
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest one.

    Pads get input_ids=pad_id, targets=-100 and position_ids 0..k-1, so they form a separate
    pseudo-sequence. There is deliberately no attention_mask: with causal attention and right
    padding real tokens never attend to pads, and transformers separates packed samples by
    position_ids only when attention_mask is None.
    """
    assert rows, "collate needs at least one row"
    width = max(len(r["input_ids"]) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    targets = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    position_ids = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        targets[b, :n] = torch.as_tensor(row["targets"], dtype=torch.long)
        position_ids[b, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
        position_ids[b, n:] = torch.arange(width - n)
    return {"input_ids": input_ids, "targets": targets, "position_ids": position_ids}
