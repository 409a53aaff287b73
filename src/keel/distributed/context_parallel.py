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
to the row's. Gradients flow back through the same exchanges. The preference stages score
whole sequences: each process sums its tokens' log-probs per sequence, the group adds
those sums up (`group_sum`), and every process of the group computes the same loss.

A vision-language model merges its image features into the embeddings of the whole row
(an image's tokens may fall into two parts): each process gets the whole padded row's ids
and positions (`shard_tokens(..., whole_inputs=True)`), encodes the row's images, embeds
it, and its language model takes its part of the embeddings
(keel.models.attention.embed_whole_row).

The query heads must split evenly over C (key/value heads are repeated up to them where C
does not divide them); `head_problem` says when they do not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

# The model-call keyword that carries the context-parallel group to keel's attention
CP_GROUP = "keel_cp_group"
# What a part takes of each sequence set ([1, T] each; M-RoPE positions [3, 1, T]), with
# the value its padding gets: pad ids, positions counting up, no target (-100,
# IGNORE_INDEX), no sequence (-1, a preference or rollout batch's index), and a log-prob of
# 0 (a rollout's old log-probs, like collate's padding)
_PER_TOKEN = {
    "input_ids": None,
    "targets": -100,
    "position_ids": None,
    "rope_position_ids": None,
    "sequence_index": -1,
    "old_logps": 0.0,
}
# What a vision-language model's forward reads whole (`shard_tokens`' whole_inputs)
_MODEL_INPUTS = ("input_ids", "position_ids", "rope_position_ids")
# A batch's sequence sets: the main one, and KTO's mismatched sequences
_PREFIXES = ("", "kl_")


def shard_tokens(
    batch: dict, rank: int, size: int, pad_id: int, *, whole_inputs: bool = False
) -> dict:
    """Part `rank` of `size` of a padding-free micro-batch (keys input_ids, targets,
    position_ids [1, T], seq_lens, the samples' lengths, and for preference and rollout
    batches sequence_index [1, T], for rollouts old_logps [1, T] and prefix_groups (a shared
    prompt's layout, keel.data.shared_prompt), for M-RoPE models rope_position_ids
    [3, 1, T]; the same under the `kl_` prefix for KTO's mismatched sequences): each row
    padded with one pseudo-sample (pad ids, no targets) to a multiple of `size`, then cut.
    `seq_lens` and `prefix_groups` stay the whole row's, which attention sees after the
    exchange; per-sequence entries (labels, reference log-probs, advantages, images) stay
    whole. With `whole_inputs` (a vision-language model, which embeds the whole row) the
    model's inputs (ids and positions) are padded but not cut."""
    out = dict(batch)
    for prefix in _PREFIXES:
        if f"{prefix}input_ids" in batch:
            out |= _part(batch, prefix, rank, size, pad_id, whole_inputs)
    return out


def _part(batch: dict, prefix: str, rank: int, size: int, pad_id: int, whole_inputs: bool) -> dict:
    keys = [f"{prefix}{key}" for key in _PER_TOKEN if f"{prefix}{key}" in batch]
    tokens = batch[f"{prefix}input_ids"].shape[-1]
    padding = -tokens % size
    out = {key: batch[key] for key in keys}
    if padding:
        for key in keys:
            value, fill = batch[key], _PER_TOKEN[key.removeprefix(prefix)]
            if key.endswith("position_ids"):  # [1, p] or [3, 1, p]
                tail = torch.arange(padding, dtype=value.dtype, device=value.device)
                tail = tail.expand(*value.shape[:-1], padding)
            else:
                tail = value.new_full((1, padding), pad_id if fill is None else fill)
            out[key] = torch.cat([value, tail], dim=-1)
        out[f"{prefix}seq_lens"] = (*batch[f"{prefix}seq_lens"], padding)
        if f"{prefix}prefix_groups" in batch:  # the pseudo-sample: a prefix of its own
            out[f"{prefix}prefix_groups"] = (*batch[f"{prefix}prefix_groups"], (padding, ()))
    start, end = _bounds(tokens + padding, rank, size)
    for key in keys:
        if not (whole_inputs and key.removeprefix(prefix) in _MODEL_INPUTS):
            out[key] = out[key][..., start:end]
    return out


def part_bounds(tokens: int, group) -> tuple[int, int]:
    """[start, end) of this process's part of a padded row of `tokens` tokens."""
    return _bounds(tokens, dist.get_rank(group), dist.get_world_size(group))


def _bounds(tokens: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of part `rank` of `size` of a row of `tokens` tokens (a multiple of
    `size`): consecutive equal parts in rank order."""
    part = tokens // size
    return rank * part, (rank + 1) * part


def group_sum(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over the processes of `group`, differentiably: the backward pass sums
    the gradients over the group too. For per-sequence sums whose parts the group's
    processes hold: each process then computes the same loss, and weighs it 1/C."""
    return _GroupSum.apply(x, group)


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_parts(part: torch.Tensor, group) -> torch.Tensor:
    """[B, t] per-token values of this process's part -> [B, C*t], the group's parts in
    group-rank order: the padded row's values (not differentiable; for values read back,
    such as a rollout's old log-probs)."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


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
