"""Context parallelism: one micro-batch's tokens split over a group of processes.

distributed.context_parallel C puts C consecutive processes in a group that reads the same
rows. Each padding-free micro-batch (one row of samples laid end to end, keel's varlen
attention) is padded to a multiple of C tokens and cut into C consecutive parts; process r
of the group runs the model on part r only, so activations, logits and the loss are 1/C
of the row's. Every layer but attention works token by token; attention needs every
token of a sample, so around it the group exchanges heads for tokens (all-to-all, the
Ulysses layout): before, each process gets H/C heads of every token; it attends within
each sample over the whole row; after, each gets back all heads of its own tokens. Targets
are shifted before the cut, so each part's loss is its tokens' and the group's parts sum
to the row's. Gradients flow back through the same exchanges.

The query heads must split evenly over C (key/value heads are repeated up to them where C
does not divide them); `head_problem` says when they do not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

# The model-call keyword that carries the context-parallel group to keel's attention
CP_GROUP = "keel_cp_group"
_PER_TOKEN = ("input_ids", "targets", "position_ids")  # [1, T] each: what a part takes


def shard_tokens(batch: dict, rank: int, size: int, pad_id: int) -> dict:
    """Part `rank` of `size` of a padding-free micro-batch (keys input_ids, targets,
    position_ids [1, T] and seq_lens, the samples' lengths): the row padded with one
    pseudo-sample (pad ids, no targets) to a multiple of `size`, then cut. `seq_lens`
    stays the whole row's, which attention sees after the exchange."""
    tokens = batch["input_ids"].shape[1]
    padding = -tokens % size
    out = dict(batch)
    if padding:
        fill = {"input_ids": pad_id, "targets": -100}  # -100: no target (IGNORE_INDEX)
        for key in _PER_TOKEN:
            value = batch[key]
            tail = (
                torch.arange(padding, dtype=value.dtype, device=value.device)[None]
                if key == "position_ids"
                else value.new_full((1, padding), fill[key])
            )
            out[key] = torch.cat([value, tail], dim=1)
        out["seq_lens"] = (*batch["seq_lens"], padding)
    part = (tokens + padding) // size
    for key in _PER_TOKEN:
        out[key] = out[key][:, rank * part : (rank + 1) * part]
    return out


def head_problem(num_heads: int, size: int) -> str | None:
    """Why the attention heads cannot be split over `size` processes, or None (key/value
    heads that do not split are repeated up to the query heads, which do)."""
    if num_heads % size:
        return (
            f"{num_heads} attention heads do not split over distributed.context_parallel = "
            f"{size} processes; use a divisor of {num_heads}"
        )
    return None


def tokens_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H, t, D], this process's t tokens of every head -> [B, H/C, C*t, D], every
    token (parts in group-rank order) of this process's H/C heads."""
    size = dist.get_world_size(group)
    batch, heads, part, dim = x.shape
    chunks = x.reshape(batch, size, heads // size, part, dim).transpose(0, 1).contiguous()
    received = _exchange(chunks, group)  # [C (whose tokens), B, H/C, t, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * part, dim)


def heads_to_tokens(y: torch.Tensor, group) -> torch.Tensor:
    """[B, T, H/C, D], every token of this process's heads -> [B, T/C, H, D], all heads
    (in group-rank order) of this process's part of the tokens."""
    size = dist.get_world_size(group)
    batch, tokens, heads, dim = y.shape
    part = tokens // size
    chunks = y.reshape(batch, size, part, heads, dim).transpose(0, 1).contiguous()
    received = _exchange(chunks, group)  # [C (whose heads), B, t, H/C, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, part, size * heads, dim)


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * times, T, D], each key/value head repeated for the
    query heads that share it (in the order grouped-query attention pairs them)."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def _exchange(chunks: torch.Tensor, group) -> torch.Tensor:
    """Send chunks[j] to group rank j and receive rank j's chunk for this one in its place
    (differentiable: the backward pass exchanges the gradients back)."""
    return wait_tensor(all_to_all_single_autograd(chunks, None, None, group))
