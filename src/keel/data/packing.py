"""Validation split, packing, and building the final rows (vectorized over Arrow buffers).

A row is one sample (unpacked) or several samples concatenated (packed) with position_ids
restarting at 0 for each. Targets are pre-shifted inside each sample and its last target is
-100, so concatenation never trains one sample to predict the next one's first token.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.data.encode import IGNORE_INDEX
from keel.errors import DataError


def split_indices(n: int, val_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) sample indices, each sorted. val_size < 1: a fraction; >= 1: a count."""
    if val_size <= 0:
        return np.arange(n), np.arange(0)
    k = int(val_size) if val_size >= 1 else max(1, round(n * val_size))
    if k >= n:
        raise DataError(
            f"data.val_size {val_size} holds out {k} of {n} usable samples, leaving none to "
            f"train on; lower data.val_size (a fraction < 1, or a count < {n})"
        )
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[k:]), np.sort(perm[:k])


def first_fit(lengths: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy first-fit over the seed-shuffled order: (sample order, samples per row).

    A max-tree over the rows' free space finds the first row with room in O(log n).
    """
    n = len(lengths)
    order = np.random.default_rng([seed, 1]).permutation(n)
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [capacity] * (2 * size)  # free[size + b] = room left in row b; inner nodes: max
    rows: list[list[int]] = []
    for idx in order.tolist():
        need = int(lengths[idx])
        assert need <= capacity, "over-length samples are handled before packing"
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(rows):
            rows.append([])
        rows[b].append(idx)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    flat = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=n)
    return flat, np.array([len(r) for r in rows], dtype=np.int64)


def build_rows(samples: pa.Table, order: np.ndarray, per_row: np.ndarray) -> pa.Table:
    """Rows of input_ids, targets, position_ids, num_targets from samples taken in `order`,
    `per_row[r]` consecutive samples making row r."""
    lengths = pc.list_value_length(samples.column("input_ids")).to_numpy().astype(np.int64)
    ids = pc.list_flatten(samples.column("input_ids")).to_numpy()
    tgt = pc.list_flatten(samples.column("targets")).to_numpy()
    starts = np.cumsum(lengths) - lengths
    lens = lengths[order]
    total = int(lens.sum())
    assert total < 2**31, "a split over 2^31 tokens needs 64-bit offsets"
    out_starts = np.cumsum(lens) - lens
    gather = np.repeat(starts[order] - out_starts, lens) + np.arange(total)
    new_tgt = tgt[gather].astype(np.int32)
    positions = (np.arange(total) - np.repeat(out_starts, lens)).astype(np.int32)
    row_ends = np.cumsum(lens)[np.cumsum(per_row) - 1] if len(per_row) else np.zeros(0, np.int64)
    offsets = pa.array(np.concatenate([[0], row_ends]).astype(np.int32))
    trained = (new_tgt != IGNORE_INDEX).astype(np.int64)
    num_targets = np.add.reduceat(trained, offsets.to_numpy()[:-1]) if len(per_row) else trained[:0]

    def as_list(values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, pa.array(values, type=pa.int32()))

    return pa.table(
        {
            "input_ids": as_list(ids[gather].astype(np.int32)),
            "targets": as_list(new_tgt),
            "position_ids": as_list(positions),
            "num_targets": pa.array(num_targets, type=pa.int64()),
        }
    )


def make_rows(samples: pa.Table, packing: bool, capacity: int, seed: int) -> pa.Table:
    """Pack `samples` into rows of at most `capacity` tokens, or keep one sample per row."""
    n = samples.num_rows
    if packing:
        lengths = pc.list_value_length(samples.column("input_ids")).to_numpy()
        order, per_row = first_fit(lengths, capacity, seed)
    else:
        order, per_row = np.arange(n), np.ones(n, dtype=np.int64)
    return build_rows(samples, order, per_row)
