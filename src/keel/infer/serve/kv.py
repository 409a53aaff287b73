"""The running batch's KV cache: sequences of different lengths, left-padded into one cache.

Row b of every layer's keys/values [B, H, T, D] holds sequence b's cached tokens in its
last columns and zeros before them; `valid` [B, T] marks the real columns. A decode step
feeds one token per row with attention_mask = [valid, 1] and position_ids = the row's own
token count, so padding never changes what a sequence sees or which positions it gets.
Joining and leaving rebuild the cache; a plain decode step only writes one column, in
place, into a buffer with room to grow (`_GrowingLayer`), instead of copying the whole
cache the way `DynamicLayer`'s concatenation does at every step.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

# Columns of headroom a rebuilt cache gets; a full buffer doubles.
MIN_ROOM = 32


class PaddedBatch:
    """A left-padded batch of per-sequence KV caches behind one transformers `Cache`."""

    def __init__(self) -> None:
        self.cache: Cache | None = None
        self.valid: torch.Tensor | None = None  # [B, T] bool

    @property
    def size(self) -> int:
        return 0 if self.valid is None else self.valid.shape[0]

    @property
    def width(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def add(self, cache: Cache, valid: torch.Tensor, rows: list[int]) -> None:
        """Append rows `rows` of a prefill's `cache` (a row may come more than once: `n`
        choices of one prompt). `valid` [G, P] marks the prefill's real columns, which
        must end at the last one. Whichever side is shorter gets left padding."""
        index = torch.tensor(rows, device=valid.device)
        keys, values = _tensors(cache)
        fresh, length = valid[index], valid.shape[1]  # [n, P]
        # Padding columns hold whatever the prefill computed for pad tokens; zero them so
        # nothing but zeros is ever carried under the mask.
        hidden = ~fresh[:, None, :, None]  # [n, 1, P, 1]
        keys = [k[index].masked_fill_(hidden, 0.0) for k in keys]
        values = [v[index].masked_fill_(hidden, 0.0) for v in values]
        if self.cache is None:
            self.cache, self.valid = _rebuild(keys, values), fresh
            return
        old_keys, old_values = _tensors(self.cache)
        width = max(self.width, length)
        keys = [
            torch.cat([_left_pad(o, width - self.width), _left_pad(n, width - length)])
            for o, n in zip(old_keys, keys)
        ]
        values = [
            torch.cat([_left_pad(o, width - self.width), _left_pad(n, width - length)])
            for o, n in zip(old_values, values)
        ]
        valid = torch.cat(
            [_left_pad_mask(self.valid, width - self.width), _left_pad_mask(fresh, width - length)]
        )
        self.cache, self.valid = _rebuild(keys, values), valid

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); columns that are padding in every kept row go."""
        if not rows:
            self.cache = self.valid = None
            return
        index = torch.tensor(rows, device=self.valid.device)
        valid = self.valid[index]  # [B', T]
        first = int(valid.any(dim=0).nonzero()[0])  # leading columns no kept row uses
        keys, values = _tensors(self.cache)
        self.cache = _rebuild(
            [k[index, :, first:] for k in keys], [v[index, :, first:] for v in values]
        )
        self.valid = valid[:, first:]

    def step_mask(self) -> torch.Tensor:
        """The attention mask [B, T + 1] of a decode step: the cache, then the new token."""
        new = torch.ones(self.size, 1, dtype=torch.bool, device=self.valid.device)
        return torch.cat([self.valid, new], dim=1).long()

    def stepped(self) -> None:
        """Record that a decode step appended one real column to every row."""
        new = torch.ones(self.size, 1, dtype=torch.bool, device=self.valid.device)
        self.valid = torch.cat([self.valid, new], dim=1)
        assert self.cache.get_seq_length() == self.width, "cache and mask out of step"


class _GrowingLayer(DynamicLayer):
    """One layer's keys/values [B, H, T, D], held in a buffer with spare columns.

    `keys`/`values` are views of the used columns; appending writes into the spare ones
    and only a full buffer is copied (into one twice as long).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.used = keys.shape[-2]
        self._key_buffer, self._value_buffer = _with_room(keys, 0), _with_room(values, 0)
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self.used + new > self._key_buffer.shape[-2]:
            self._key_buffer = _with_room(self.keys, new)
            self._value_buffer = _with_room(self.values, new)
        self._key_buffer[:, :, self.used : self.used + new] = key_states
        self._value_buffer[:, :, self.used : self.used + new] = value_states
        self.used += new
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.used

    def _expose(self) -> None:
        self.keys = self._key_buffer[:, :, : self.used]
        self.values = self._value_buffer[:, :, : self.used]


def _with_room(states: torch.Tensor, needed: int) -> torch.Tensor:
    batch, heads, length, dim = states.shape
    room = max(MIN_ROOM, length, needed)  # doubling keeps appends amortized O(1)
    buffer = states.new_zeros(batch, heads, length + room, dim)
    buffer[:, :, :length] = states
    return buffer


def _tensors(cache: Cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [layer.keys for layer in cache.layers]  # each [B, H, T, D]
    values = [layer.values for layer in cache.layers]
    assert all(k is not None for k in keys), "every layer must hold its own KV cache"
    return keys, values


def _rebuild(keys: list[torch.Tensor], values: list[torch.Tensor]) -> Cache:
    # Plain full-history layers: a sliding-window layer would drop columns and break the
    # one-column-per-position layout the mask relies on.
    return Cache(layers=[_GrowingLayer(k, v) for k, v in zip(keys, values)])


def _left_pad(states: torch.Tensor, columns: int) -> torch.Tensor:
    if columns == 0:
        return states
    batch, heads, _, dim = states.shape
    pad = states.new_zeros(batch, heads, columns, dim)  # zeros: masked, yet never NaN
    return torch.cat([pad, states], dim=2)


def _left_pad_mask(valid: torch.Tensor, columns: int) -> torch.Tensor:
    if columns == 0:
        return valid
    pad = valid.new_zeros(valid.shape[0], columns)
    return torch.cat([pad, valid], dim=1)
