"""Exact duplicates: drop each prepared sample identical to an earlier one (data.deduplicate).

Samples compare by everything that trains: their tokens, targets and (for pairs, KTO
samples, images) the other prepared columns, so two rows that differ only in columns keel
does not read count as the same. Run before the split, so no eval sample is a copy of a
training one, and the first of each group of copies is kept (the order of the files).
"""

from __future__ import annotations

import hashlib

import pyarrow as pa


def drop_duplicates(samples: pa.Table) -> tuple[pa.Table, int]:
    """(`samples` without the rows that repeat an earlier row, how many were dropped)."""
    seen: set[bytes] = set()
    keep: list[int] = []
    index = 0
    for batch in samples.to_batches(max_chunksize=4096):
        for row in batch.to_pylist():
            digest = hashlib.sha256(repr(sorted(row.items())).encode()).digest()
            if digest not in seen:
                seen.add(digest)
                keep.append(index)
            index += 1
    dropped = samples.num_rows - len(keep)
    if not dropped:
        return samples, 0
    return samples.take(pa.array(keep, type=pa.int64())), dropped
