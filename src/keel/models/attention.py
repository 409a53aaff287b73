"""Attention over samples laid end to end: what makes padding-free micro-batches exact.

A padding-free micro-batch is its rows concatenated into one row, position ids restarting
with each sample. Attention must then stay inside each sample. Transformers' sdpa path
does that with a block-diagonal [T, T] mask built from the position ids, which on a CPU
computes every block (the mask hides what the kernel still multiplies) and reads the
position ids back to find the blocks. `sdpa_varlen` instead runs causal sdpa on each
sample's slice of q, k and v, with lengths the collator computed on the host: the work of
the unpadded samples, nothing on padding or across samples, no mask, no device sync.

Under context parallelism (keel.distributed.context_parallel) each process holds a part of
the row's tokens: `kwargs[CP_GROUP]` names its group, and the heads are exchanged for
tokens around the same computation.

It is registered with transformers' AttentionInterface as VARLEN_ATTENTION; a model is
switched to it only after `CausalLMObjective.check_varlen_attention` has compared it with
the model's own attention on two samples laid end to end, so a family whose attention does
more (soft-capping, sinks, its own sdpa call) keeps padded micro-batches.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from keel.distributed.context_parallel import (
    CP_GROUP,
    head_problem,
    heads_to_tokens,
    part_bounds,
    repeat_kv,
    tokens_to_heads,
)

VARLEN_ATTENTION = "keel_sdpa_varlen"
# The model-call keyword that carries the sample lengths of the one concatenated row
SEQ_LENS = "keel_seq_lens"
# ... and the one that says the row's samples share prompts (keel.data.shared_prompt): per
# group, (prefix length, segment lengths); each segment sees the prefix and itself
PREFIX_GROUPS = "keel_prefix_groups"
# Keywords some families pass to their attention function that change what it computes;
# sdpa_varlen refuses them rather than ignoring them (sliding windows it implements).
_UNSUPPORTED = ("softcap", "s_aux", "sinks")


def sdpa_varlen(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sample of a row; transformers' attention signature.

    query [B, H, T, D], key and value [B, Hkv, T, D] (grouped-query heads are shared by
    sdpa itself, not repeated). `kwargs[SEQ_LENS]`: the lengths of the samples of a single
    row (B == 1), summing to T; absent, the rows are independent causal sequences (right
    padding is invisible to real tokens). `kwargs[PREFIX_GROUPS]`, when given, describes the
    single row instead: groups of a shared prefix and segments that each see it, one masked
    sdpa per group. A `sliding_window` applies within each sample, as transformers defines
    it. Returns ([B, T, H, D], None). With `kwargs[CP_GROUP]` (context parallelism) T is
    this process's part of the row, and `kwargs[SEQ_LENS]` describes the whole row.
    """
    group = kwargs.get(CP_GROUP)
    if group is not None:
        if key.shape[1] % torch.distributed.get_world_size(group):
            times = query.shape[1] // key.shape[1]  # as many kv heads as query heads
            key, value = repeat_kv(key, times), repeat_kv(value, times)
        query, key, value = (tokens_to_heads(x, group) for x in (query, key, value))
    output = _attend_row(module, (query, key, value), attention_mask, dropout, scaling, kwargs)
    if group is not None:
        output = heads_to_tokens(output, group)
    return output, None


def _attend_row(module: nn.Module, qkv, attention_mask, dropout: float, scaling, kwargs):
    """`sdpa_varlen`'s attention over every token of the row: [B, T, H, D]."""
    query, key, value = qkv
    extras = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if attention_mask is not None:
        extras.append("an attention mask")
    if not getattr(module, "is_causal", True):
        extras.append("non-causal attention")
    if extras:
        raise ValueError(
            f"{VARLEN_ATTENTION} computes plain causal attention; this model's attention "
            f"also uses {', '.join(extras)}"
        )
    grouped = query.shape[1] != key.shape[1]
    window = kwargs.get("sliding_window")

    def attend(q, k, v):
        return _attend_sample((q, k, v), window, dropout=dropout, scale=scaling, gqa=grouped)

    seq_lens = kwargs.get(SEQ_LENS)
    groups = kwargs.get(PREFIX_GROUPS)
    if groups:
        output = _attend_groups(
            (query, key, value), groups, window, dropout=dropout, scale=scaling, gqa=grouped
        )  # [1, H, T, D]
    elif not seq_lens or len(seq_lens) == 1:
        output = attend(query, key, value)  # [B, H, T, D]
    else:
        _check_one_row(query, seq_lens, SEQ_LENS)
        # split (not slicing) so that backward concatenates the gradients once
        pieces = zip(query.split(seq_lens, 2), key.split(seq_lens, 2), value.split(seq_lens, 2))
        output = torch.cat([attend(q, k, v) for q, k, v in pieces], dim=2)  # [1, H, T, D]
    return output.transpose(1, 2).contiguous()


def _attend_sample(
    qkv: tuple[torch.Tensor, ...],
    window: int | None,
    *,
    dropout: float,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Causal attention within one sample [B, H, T, D] (or right-padded rows), under a
    sliding `window` when given; the other arguments as sdpa_varlen got them."""
    query, key, value = qkv
    if window is None or query.shape[2] <= window:  # the window reaches the sample's start
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
    return _attend_window(qkv, window, dropout=dropout, scale=scale, gqa=gqa)


def _attend_window(
    qkv: tuple[torch.Tensor, ...], window: int, *, dropout: float, scale: float | None, gqa: bool
) -> torch.Tensor:
    """Transformers' sliding window (query i sees keys j with i - window < j <= i) over one
    sample longer than the window, a block of `window` queries at a time: the first block
    is plain causal attention, each later one sees its own keys and the window - 1 before
    them through one band mask (`_band`) of [window, 2 window - 1], the same for every
    block. A mask over the whole sample would be [T, T] (kept for backward by every layer:
    1 GiB each at 32k tokens); this computes and keeps O(T x window). Returns [B, H, T, D]."""
    query, key, value = qkv
    n = query.shape[2]
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, :window], key[:, :, :window], value[:, :, :window], dropout_p=dropout,
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
    ]  # fmt: skip
    band = _band(window, query.device)
    for start in range(window, n, window):
        end, first = min(start + window, n), start - window + 1
        seen = band[: end - start, : end - first]  # a partial last block: the band's corner
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, first:end], value[:, :, first:end],
                attn_mask=seen, dropout_p=dropout, scale=scale, enable_gqa=gqa,
            )
        )  # fmt: skip
    return torch.cat(outputs, dim=2)


@functools.lru_cache(maxsize=8)
def _band(window: int, device: torch.device) -> torch.Tensor:
    """[window, 2 window - 1] bool: block query r sees block key c (the block's keys start
    window - 1 before its first query) when r <= c <= r + window - 1. One tensor for every
    block and layer: the mask is the same wherever the block is."""
    r = torch.arange(window, device=device)[:, None]
    c = torch.arange(2 * window - 1, device=device)[None, :]
    return (c >= r) & (c <= r + window - 1)


def _attend_groups(
    qkv: tuple[torch.Tensor, ...],
    groups,
    window: int | None,
    *,
    dropout: float,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Attention over a row of prefix groups (PREFIX_GROUPS); the other arguments as
    sdpa_varlen got them. Returns [1, H, T, D].

    A group's prefix is a sample of its own (`_attend_sample`: causal, in blocks under a
    sliding window). Its segments' queries (the completions, few next to a long prompt)
    attend over the group's keys with a mask of [segment tokens, group tokens]: no
    [T_g, T_g] mask, whose size (and that of the float mask sdpa makes of it) grows with
    the prompt's square."""
    query, key, value = qkv
    lengths = [prefix + sum(segments) for prefix, segments in groups]
    _check_one_row(query, lengths, PREFIX_GROUPS)
    pieces = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    outputs = []
    for (q, k, v), (prefix, segments) in zip(pieces, groups):
        if prefix:
            own = (q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix])
            outputs.append(_attend_sample(own, window, dropout=dropout, scale=scale, gqa=gqa))
        if segments:
            seen = _group_mask(prefix, segments, window, q.device)  # [S_g, T_g]
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, prefix:], k, v, attn_mask=seen, dropout_p=dropout, scale=scale,
                    enable_gqa=gqa,
                )
            )  # fmt: skip
    return torch.cat(outputs, dim=2)


def _check_one_row(query: torch.Tensor, lengths, keyword: str) -> None:
    if query.shape[0] != 1 or sum(lengths) != query.shape[2]:
        raise ValueError(
            f"{keyword} (sample lengths {tuple(lengths)}) does not describe one row of "
            f"{query.shape[2]} tokens (batch {query.shape[0]})"
        )


def _group_mask(
    prefix: int, segments: tuple[int, ...], window: int | None, device: torch.device
) -> torch.Tensor:
    """Where a query may attend (bool, True: it may): within the prefix causally; from a
    segment to the whole prefix and causally within the segment. Positions continue the
    prefix in every segment, so a sliding window counts distances as in the sample the
    segment stands for (its prompt followed by it). [S, T]: the rows of the segments' S
    queries (the prefix attends as a sample of its own)."""
    segment = torch.repeat_interleave(
        torch.arange(len(segments) + 1, device=device),
        torch.tensor([prefix, *segments], device=device),
    )  # [T]: 0 on the prefix, i on segment i
    position = torch.cat(
        [torch.arange(prefix, device=device)]
        + [torch.arange(prefix, prefix + n, device=device) for n in segments]
    )  # [T]
    at, asks = position[prefix:, None], segment[prefix:, None]  # the queries' [S, 1]
    seen = (segment[None, :] == 0) | (segment[None, :] == asks)  # [S, T]
    seen &= position[None, :] <= at
    if window is not None:
        seen &= position[None, :] > at - window
    return seen


def register_varlen_attention() -> None:
    """Make VARLEN_ATTENTION a name transformers' models accept (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, sdpa_varlen)


def context_parallel_problem(model: nn.Module, size: int) -> str | None:
    """Why distributed.context_parallel = `size` cannot split `model`'s rows, or None: a
    vision-language model whose image tokens attend both ways (keel's varlen attention is
    causal), or query heads that do not divide over the group."""
    from keel.models.vision import family_of

    if size == 1:
        return None
    key = f"distributed.context_parallel = {size}"
    family = family_of(model.config)
    if family is not None and family.image_attention != "causal":
        return (
            f"{key}: {type(model).__name__}'s image tokens attend to each other both ways, "
            f"and context parallelism splits rows inside keel's varlen attention, which is "
            f"causal only (use 1)"
        )
    problem = head_problem(model.config.get_text_config().num_attention_heads, size)
    return None if problem is None else f"{key}: {type(model).__name__}: {problem}"


def embed_whole_row(language_model: nn.Module) -> None:
    """Let a vision-language model run context parallel (idempotent).

    Its forward merges image features into the embeddings of the row, and an image's tokens
    may fall into two processes' parts; so each process gets the whole (padded) row's ids
    and positions (`shard_tokens(..., whole_inputs=True)`) and its images, and a hook on
    `language_model` (the family's decoder stack) cuts out this process's part of the
    embeddings, the positions and, for Qwen3-VL, the image features its first layers add
    (deepstack) before the first layer runs. Without CP_GROUP in the call it does nothing.
    """
    if not getattr(language_model, "_keel_embeds_whole_row", False):
        language_model.register_forward_pre_hook(_take_part_of_row, with_kwargs=True)
        language_model._keel_embeds_whole_row = True


def _take_part_of_row(module: nn.Module, args: tuple, kwargs: dict):
    group = kwargs.get(CP_GROUP)
    if group is None:
        return None
    embeds = kwargs.get("inputs_embeds")
    if args or embeds is None or embeds.shape[0] != 1:
        raise RuntimeError(
            f"context parallelism: {type(module).__name__} was not called with one row's "
            "inputs_embeds by keyword, so keel cannot cut out this process's part"
        )
    whole = sum(kwargs[SEQ_LENS])
    if embeds.shape[1] != whole:
        raise RuntimeError(
            f"context parallelism: {type(module).__name__} got {embeds.shape[1]} embedded "
            f"tokens, not the whole row's {whole}"
        )
    start, end = part_bounds(whole, group)
    kwargs = dict(kwargs, inputs_embeds=embeds[:, start:end])
    if kwargs.get("position_ids") is not None:  # [1, T], or [3 or 4, 1, T] (M-RoPE)
        kwargs["position_ids"] = kwargs["position_ids"][..., start:end]
    visual = kwargs.get("visual_pos_masks")  # [1, T]: where deepstack features are added
    if visual is not None:
        before, mine = int(visual[:, :start].sum()), int(visual[:, start:end].sum())
        kwargs["visual_pos_masks"] = visual[:, start:end]
        kwargs["deepstack_visual_embeds"] = [
            features[before : before + mine] for features in kwargs["deepstack_visual_embeds"]
        ]
    return args, kwargs


def requested_attention(attn_implementation: str, context_parallel: int) -> str:
    """model.attn_implementation as the model is built: `auto` under context parallelism
    is sdpa, which keel's varlen attention replaces and splits (flash-attn's would not)."""
    return "sdpa" if attn_implementation == "auto" and context_parallel > 1 else attn_implementation


def auto_attention(config) -> str | None:
    """`model.attn_implementation: auto` for a model `config`: flash_attention_2 where it can
    run (a CUDA GPU, flash-attn installed, an architecture that supports it), else None,
    which lets transformers choose sdpa where the architecture has an sdpa path and eager
    where it does not (Gemma 2). The caller reads the choice back from the built model."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_flash_attn_2_available

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)  # None: remote code
    if model_class is None or not torch.cuda.is_available():
        return None
    if model_class._supports_flash_attn and is_flash_attn_2_available():
        return "flash_attention_2"
    return None
