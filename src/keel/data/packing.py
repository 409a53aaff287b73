"""Validation split, packing, and building the final rows (vectorized over Arrow buffers).

A row is one unit (unpacked) or several units concatenated (packed): a unit is a sample
(pt, sft), a pair (dpo, orpo, simpo: two sequences) or a KTO sample; units are never split.
position_ids restart at 0 with each sequence. Targets are pre-shifted inside each sequence
and its last target is -100, so concatenation never trains one sequence to predict the next
one's first token.

A vision-language run's units also carry `image_blobs` (one per image) and `rope_positions`
(3 per token); a row concatenates them in the order of its units, like its tokens.
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


def gather_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Indices that lay the ranges [starts[k], starts[k] + lens[k]) end to end."""
    out_starts = np.cumsum(lens) - lens
    return np.repeat(starts - out_starts, lens) + np.arange(int(lens.sum()))


def restart_positions(seq_lens: np.ndarray) -> np.ndarray:
    """Position ids of sequences of `seq_lens` tokens laid end to end: 0.. in each."""
    starts = np.cumsum(seq_lens) - seq_lens
    return (np.arange(int(seq_lens.sum())) - np.repeat(starts, seq_lens)).astype(np.int32)


def cut_into_pieces(units: pa.Table, cutoff_len: int, min_len: int = 0) -> pa.Table:
    """Pretraining samples (input_ids, targets) cut into pieces of at most `cutoff_len`
    tokens, in order (data.overlength=split).

    A document of n tokens gives ceil(n / cutoff_len) pieces, each a sample of its own: its
    last target is -100 like every sequence's, so no piece is trained to predict the next
    one's first token. A piece that would train no token (a last piece of one token) is left
    out, and so is one of fewer than `min_len` tokens (data.min_len: a document's short last
    piece, as Axolotl drops the short chunks of its completion texts)."""
    extra = set(units.column_names) - {"input_ids", "targets"}
    assert not extra, f"only text samples are cut into pieces, not ones with {sorted(extra)}"
    ids_column, targets_column = units.column("input_ids"), units.column("targets")
    lengths = pc.list_value_length(ids_column).to_numpy().astype(np.int64)
    if not len(lengths) or lengths.max() <= cutoff_len:
        return units
    counts = -(-lengths // cutoff_len)  # pieces per sample
    first_piece = np.cumsum(counts) - counts
    index = np.arange(int(counts.sum())) - np.repeat(first_piece, counts)  # within its sample
    starts = np.repeat(np.cumsum(lengths) - lengths, counts) + index * cutoff_len
    lens = np.minimum(cutoff_len, np.repeat(lengths, counts) - index * cutoff_len)
    ids = pc.list_flatten(ids_column).to_numpy()
    targets = pc.list_flatten(targets_column).to_numpy().copy()
    targets[starts + lens - 1] = IGNORE_INDEX
    # the pieces are consecutive and cover every token, so reduceat sums each one's targets
    trained = np.add.reduceat((targets != IGNORE_INDEX).astype(np.int64), starts)
    kept = (trained > 0) & (lens >= min_len)
    starts, lens = starts[kept], lens[kept]
    taken = gather_ranges(starts, lens)
    ends = np.concatenate([[0], np.cumsum(lens)])
    return pa.table(
        {"input_ids": _as_list(ends, ids[taken]), "targets": _as_list(ends, targets[taken])}
    )


def _regroup(column, order: np.ndarray, bounds: np.ndarray):
    """Concatenate the lists of `column` taken in `order`, rows ending at unit `bounds`:
    (values, each taken list's length, each row's end offset into values)."""
    lengths = pc.list_value_length(column).to_numpy().astype(np.int64)
    flat = pc.list_flatten(column).to_numpy()
    starts = np.cumsum(lengths) - lengths
    lens = lengths[order]
    values = flat[gather_ranges(starts[order], lens)]
    ends = np.concatenate([[0], np.cumsum(lens)])[bounds]
    return values, lens, ends


def _as_list(ends: np.ndarray, values: np.ndarray) -> pa.ListArray:
    assert ends[-1] < 2**31, "a split over 2^31 tokens needs 64-bit offsets"
    offsets = pa.array(ends.astype(np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.astype(np.int32), type=pa.int32()))


def _regroup_blobs(column, order: np.ndarray, bounds: np.ndarray) -> pa.ListArray:
    """`_regroup` for a list-of-binary column (kept as Arrow: the values are not numbers)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = pc.list_value_length(column).to_numpy().astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    lens = lengths[order]
    values = pc.list_flatten(column).take(pa.array(gather_ranges(starts[order], lens)))
    ends = np.concatenate([[0], np.cumsum(lens)])[bounds]
    return pa.ListArray.from_arrays(pa.array(ends.astype(np.int32)), values)


def _vision_columns(units: pa.Table, order: np.ndarray, bounds: np.ndarray) -> dict:
    out = {}
    if "image_blobs" in units.column_names:
        out["image_blobs"] = _regroup_blobs(units.column("image_blobs"), order, bounds)
    for name in ("rope_positions", "kl_rope_positions"):  # KTO's KL sequences have their own
        if name in units.column_names:
            values, _, ends = _regroup(units.column(name), order, bounds)
            out[name] = _as_list(ends, values)
    return out


def build_rows(units: pa.Table, order: np.ndarray, per_row: np.ndarray) -> pa.Table:
    """Rows from `units` taken in `order`, `per_row[r]` consecutive units making row r.

    A unit is a sample (pt, sft), a pair or a KTO sample; its `input_ids`/`targets` hold
    its sequences laid end to end, `seq_lens` their lengths (absent: one sequence). Rows get
    input_ids, targets, position_ids (restarting at 0 with each sequence) and num_targets:
    the trained tokens, or with `labels` (preference units) the units in the row; then
    labels, and kl_input_ids/kl_targets/kl_position_ids when the units have KL sequences;
    and image_blobs / rope_positions (kl_rope_positions) when the units have them. A KL
    sequence's images are its sample's: a row's image_blobs serve both.
    """
    names = units.column_names
    bounds = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)
    ids, lens, ends = _regroup(units.column("input_ids"), order, bounds)
    targets = _regroup(units.column("targets"), order, bounds)[0]
    if "seq_lens" in names:
        lens = _regroup(units.column("seq_lens"), order, bounds)[0].astype(np.int64)
    out = {
        "input_ids": _as_list(ends, ids),
        "targets": _as_list(ends, targets),
        "position_ids": _as_list(ends, restart_positions(lens)),
    }
    if "labels" in names:
        out["num_targets"] = pa.array(np.asarray(per_row, dtype=np.int64), type=pa.int64())
        labels, _, label_ends = _regroup(units.column("labels"), order, bounds)
        out["labels"] = _as_list(label_ends, labels)
    else:
        trained = (targets != IGNORE_INDEX).astype(np.int64)
        num_targets = np.add.reduceat(trained, ends[:-1]) if len(per_row) else trained[:0]
        out["num_targets"] = pa.array(num_targets, type=pa.int64())
    if "margin" in names:  # rm's pairs: one float each, in the order of their labels
        margins, _, margin_ends = _regroup(units.column("margin"), order, bounds)
        offsets = pa.array(margin_ends.astype(np.int32))
        out["margin"] = pa.ListArray.from_arrays(offsets, pa.array(margins.astype(np.float32)))
    if "kl_input_ids" in names:
        kl_ids, kl_lens, kl_ends = _regroup(units.column("kl_input_ids"), order, bounds)
        out["kl_input_ids"] = _as_list(kl_ends, kl_ids)
        out["kl_targets"] = _as_list(
            kl_ends, _regroup(units.column("kl_targets"), order, bounds)[0]
        )
        out["kl_position_ids"] = _as_list(kl_ends, restart_positions(kl_lens))
    return pa.table(out | _vision_columns(units, order, bounds))


def make_rows(units: pa.Table, packing: bool, capacity: int, seed: int) -> pa.Table:
    """Pack `units` into rows of at most `capacity` tokens, or keep one unit per row.

    A KTO sample and its KL sequence both fit: packing uses the longer of the two, so the
    KL sequences of a row fit `capacity` as well."""
    n = units.num_rows
    if packing:
        lengths = pc.list_value_length(units.column("input_ids")).to_numpy()
        if "kl_input_ids" in units.column_names:
            kl = pc.list_value_length(units.column("kl_input_ids")).to_numpy()
            lengths = np.maximum(lengths, kl)
        order, per_row = first_fit(lengths, capacity, seed)
    else:
        order, per_row = np.arange(n), np.ones(n, dtype=np.int64)
    return build_rows(units, order, per_row)
