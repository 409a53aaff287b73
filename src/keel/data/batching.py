"""Epoch order and collation of prepared rows into tensors."""

from __future__ import annotations

import torch

from keel.data.encode import IGNORE_INDEX
from keel.data.shared_prompt import (
    can_share,
    sample_lengths,
    sequence_index,
    share_pair_prompts,
    share_prompts,
)


def epoch_order(num_rows: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Row order for one epoch: a permutation from a torch.Generator seeded with seed + epoch,
    or 0..num_rows-1 when not shuffling. Same arguments, same order, on every rank."""
    if not shuffle:
        return list(range(num_rows))
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


def collate(
    rows: list[dict], pad_id: int, *, padding_free: bool = False, share_pairs: bool = False
) -> dict:
    """Right-pad rows to the longest one, or (`padding_free`) lay them end to end.

    Padding-free, the micro-batch is one row holding every row's samples (position ids
    restarting with each), so no position computes padding; the batch then also carries
    `seq_lens` (and `kl_seq_lens`): each sample's length, a tuple of ints for keel's varlen
    attention (keel.models.attention), which keeps attention inside each sample.

    Pads get input_ids=pad_id, targets=-100 and position_ids 0..k-1, so they form a separate
    pseudo-sequence. There is deliberately no attention_mask: with causal attention and right
    padding real tokens never attend to pads, and transformers separates packed samples by
    position_ids only when attention_mask is None.

    Preference rows (they carry `labels`, one per sequence) also get `labels` [S] (the
    sequences of all rows, in order), `sequence_index` [B, T] (which of those S sequences a
    token belongs to, -1 for padding), the same for their KTO mismatched sequences under a
    `kl_` prefix, `reference_logps` / `reference_kl_logps` [S] when the rows carry
    precomputed reference log-probs, and `margin` [P] (rm's pairs).

    A vision-language run's rows also give `images` (each image's tensors, unpacked from
    `image_blobs`, in token order: row after row; absent when there are none) and, with
    `rope_positions`, `rope_position_ids` [3, B, T] (M-RoPE; pads count up as position_ids);
    KTO rows' KL sequences `kl_rope_position_ids` (their images are the rows' `images`).

    Rollout rows (grpo: a prompt and one sampled completion, keel.train.rollouts) carry
    `advantages` (a list of one float) and give `advantages` [S] float32, `kept` [S] (1.0, or
    0.0 for a completion masked out of the loss), `sequence_index` [B, T] as above, and
    `old_logps` [B, T] float32 (aligned with targets, 0 on padding) when the rows carry the
    log-probs they were sampled with. Padding-free rollout rows that carry `prompt_len` are
    laid out with each prompt once (keel.data.shared_prompt) and give `prefix_groups` too.
    So are padding-free rows of preference pairs with `share_pairs` (dpo, orpo, simpo and rm
    on a text model: each pair's prompt once for its chosen and rejected sequences).
    """
    assert rows, "collate needs at least one row"
    if padding_free and can_share(rows):
        return _shared_rollout(rows, pad_id)
    if padding_free and share_pairs:
        return _shared_pairs(rows, pad_id)
    if padding_free:
        rows = [merge_rows(rows)]
    batch = _pad(rows, "", pad_id)
    if padding_free:
        batch["seq_lens"] = sample_lengths(rows[0]["position_ids"])
    else:  # where each row's padding starts (a router's balance leaves padding out)
        batch["row_lengths"] = torch.tensor([len(r["input_ids"]) for r in rows])
    batch |= _vision(rows, batch["position_ids"])
    if "advantages" in rows[0]:
        return batch | _rollout(rows, batch["input_ids"].shape[1])
    if not rows[0].get("labels"):
        return batch
    batch["sequence_index"] = _sequence_index(rows, "", batch["input_ids"].shape[1])
    if rows[0].get("kl_input_ids"):
        batch |= _pad(rows, "kl_", pad_id)
        width = batch["kl_input_ids"].shape[1]
        batch["kl_sequence_index"] = _sequence_index(rows, "kl_", width)
        if padding_free:
            batch["kl_seq_lens"] = sample_lengths(rows[0]["kl_position_ids"])
        batch |= _kl_vision(rows, batch)
    return batch | _per_sequence(rows)


def _per_sequence(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A preference batch's `labels` [S] and, when the rows carry them, its precomputed
    reference log-probs [S] and rm's margins [P]."""
    out = {"labels": torch.tensor([x for row in rows for x in row["labels"]], dtype=torch.long)}
    for key in ("reference_logps", "reference_kl_logps", "margin"):
        if key in rows[0]:
            values = [x for row in rows for x in row[key]]
            out[key] = torch.tensor(values, dtype=torch.float32)
    return out


def _shared_pairs(rows: list[dict], pad_id: int) -> dict:
    """Padding-free preference pairs with each pair's prompt computed once
    (keel.data.shared_prompt): one row, `prefix_groups` for keel's varlen attention,
    `seq_lens` its groups' lengths, the sequences numbered as collate numbers them."""
    merged, groups = share_pair_prompts(merge_rows(rows))
    return _grouped_row(merged, groups, pad_id) | _per_sequence(rows)


def _rollout(rows: list[dict], width: int) -> dict[str, torch.Tensor]:
    """`advantages` [S], `sequence_index` [B, T] and, if present, `old_logps` [B, T]."""
    advantages = [a for row in rows for a in row["advantages"]]
    out = {
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "sequence_index": _sequence_index(rows, "", width),
    }
    if "kept" in rows[0]:  # 0.0: a completion masked out of the loss (truncated)
        out["kept"] = torch.tensor([k for row in rows for k in row["kept"]], dtype=torch.float32)
    if "old_logps" in rows[0]:
        old = torch.zeros((len(rows), width), dtype=torch.float32)  # [B, T]
        for b, row in enumerate(rows):
            old[b, : len(row["old_logps"])] = torch.as_tensor(row["old_logps"], dtype=torch.float32)
        out["old_logps"] = old
    return out


def _shared_rollout(rows: list[dict], pad_id: int) -> dict:
    """Padding-free rollout rows with each prompt computed once (keel.data.shared_prompt):
    one row, `prefix_groups` for keel's varlen attention, `seq_lens` its groups' lengths."""
    merged, groups = share_prompts(rows)
    rollout = _rollout([merged], len(merged["input_ids"]))
    return rollout | _grouped_row(merged, groups, pad_id)  # the groups' sequence numbers


def _grouped_row(merged: dict, groups, pad_id: int) -> dict:
    """One row laid out in prefix groups (keel.data.shared_prompt): its tokens,
    `prefix_groups` for keel's varlen attention, `seq_lens` the groups' lengths and
    `sequence_index` [1, T] (-1 on a prefix, then one number per segment in order)."""
    batch = _pad([merged], "", pad_id)
    batch["prefix_groups"] = groups
    batch["seq_lens"] = tuple(prefix + sum(segments) for prefix, segments in groups)
    batch["sequence_index"] = torch.tensor([sequence_index(groups)], dtype=torch.long)  # [1, T]
    return batch


def merge_rows(rows: list[dict]) -> dict:
    """`rows` laid end to end as one row: every list (tokens, position ids, per-sequence
    labels and reference log-probs) concatenated in row order, every count summed.

    Sequences keep their order, so the k-th sequence of the merged row is the k-th of the
    rows taken in order, as collate numbers them padded."""
    if len(rows) == 1:
        return rows[0]
    merged = {}
    for key, value in rows[0].items():
        if isinstance(value, list | tuple):
            merged[key] = [x for row in rows for x in row[key]]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            merged[key] = sum(row[key] for row in rows)
        else:
            raise TypeError(f"merge_rows: cannot merge row field {key!r} of type {type(value)}")
    return merged


def _vision(rows: list[dict], position_ids: torch.Tensor) -> dict:
    """`images` and `rope_position_ids` of a vision-language run's rows ({} for text rows)."""
    out = {}
    blobs = [blob for row in rows for blob in row.get("image_blobs") or ()]
    if blobs:
        from keel.models.vision.blobs import unpack

        out["images"] = [unpack(blob) for blob in blobs]
    if "rope_positions" in rows[0]:
        out["rope_position_ids"] = _rope(rows, "", position_ids)
    return out


def _kl_vision(rows: list[dict], batch: dict) -> dict:
    """KTO's KL sequences in a vision-language run: their 3-D rotary positions (their
    images are the samples' `images`: each KL sequence starts with its sample's prompt,
    rows in the same order)."""
    if "kl_rope_positions" not in rows[0]:
        return {}
    return {"kl_rope_position_ids": _rope(rows, "kl_", batch["kl_position_ids"])}


def _rope(rows: list[dict], prefix: str, position_ids: torch.Tensor) -> torch.Tensor:
    """[3, B, T] rotary positions from the rows' `{prefix}rope_positions` (3 per token);
    padding counts up as `position_ids` do."""
    rope = position_ids.unsqueeze(0).repeat(3, 1, 1)
    for b, row in enumerate(rows):
        positions = torch.as_tensor(row[f"{prefix}rope_positions"], dtype=torch.long).view(-1, 3)
        rope[:, b, : len(positions)] = positions.t()
    return rope


def _pad(rows: list[dict], prefix: str, pad_id: int) -> dict[str, torch.Tensor]:
    """{prefix}input_ids, {prefix}targets, {prefix}position_ids, each [B, T], right-padded."""
    ids_key, targets_key, positions_key = (
        f"{prefix}input_ids",
        f"{prefix}targets",
        f"{prefix}position_ids",
    )
    width = max(len(r[ids_key]) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    targets = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    position_ids = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    for b, row in enumerate(rows):
        n = len(row[ids_key])
        input_ids[b, :n] = torch.as_tensor(row[ids_key], dtype=torch.long)
        targets[b, :n] = torch.as_tensor(row[targets_key], dtype=torch.long)
        position_ids[b, :n] = torch.as_tensor(row[positions_key], dtype=torch.long)
        position_ids[b, n:] = torch.arange(width - n)
    return {ids_key: input_ids, targets_key: targets, positions_key: position_ids}


def _sequence_index(rows: list[dict], prefix: str, width: int) -> torch.Tensor:
    """[B, T]: the batch-wide number of the sequence each token belongs to; -1 on padding.

    A sequence starts where its position id is 0, so a row's k-th sequence (in row order) is
    number k plus the sequences of the rows before it."""
    index = torch.full((len(rows), width), -1, dtype=torch.long)
    offset = 0
    for b, row in enumerate(rows):
        positions = torch.as_tensor(row[f"{prefix}position_ids"], dtype=torch.long)
        local = torch.cumsum(positions == 0, 0) - 1  # [n]
        index[b, : len(positions)] = local + offset
        offset += int(local[-1]) + 1 if len(positions) else 0
    return index
