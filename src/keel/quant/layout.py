"""Which frozen linear weights QLoRA stores in NF4, and how many bytes that takes.

Pure arithmetic (no torchao), shared by the loader and the memory planner so that
`keel plan` counts exactly what training allocates.

NF4 (QLoRA's 4-bit NormalFloat, torchao's layout): the weight, flattened, is cut into
blocks of 64 values; each value is a 4-bit index into 16 levels (two per byte), scaled by
its block's absmax. The absmaxes are themselves quantised ("double quantisation") to int8,
after subtracting their mean over the whole tensor, with one fp scale per `scaler_block`
of them. The scaler block is chosen from the shape alone, so a weight is quantised the same
way on any number of processes; FSDP2 splits the rows, and each shard must hold whole
scaler blocks.
"""

from __future__ import annotations

NF4_BLOCK = 64  # values per absmax scale
MAX_SCALER_BLOCK = 256  # absmax scales per second-level scale (torchao's default)
# Scaler blocks are sized so that a weight splits evenly over up to this many processes
# (any divisor of it); other process counts keep the weights that do not split evenly in
# the compute dtype.
SHARD_ALIGN = 8


def scaler_block(rows: int, cols: int) -> int | None:
    """Absmax scales per second-level scale for a [rows, cols] weight; None: not NF4-able
    (its size is not a multiple of the 64-value block)."""
    numel = rows * cols
    if numel == 0 or numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    if blocks % SHARD_ALIGN == 0:
        blocks //= SHARD_ALIGN
    size = MAX_SCALER_BLOCK
    while blocks % size:
        size //= 2
    return size


def quantizable(rows: int, cols: int, world: int = 1) -> bool:
    """Whether a [rows, cols] weight can be NF4 with its rows split over `world` shards."""
    size = scaler_block(rows, cols)
    if size is None:
        return False
    if world == 1:
        return True
    blocks = rows * cols // NF4_BLOCK
    return rows % world == 0 and blocks % world == 0 and (blocks // world) % size == 0


def nf4_bytes(rows: int, cols: int, compute_itemsize: int, world: int = 1) -> int:
    """Bytes one shard (of `world`) of an NF4 [rows, cols] weight holds: 4-bit codes, int8
    absmax codes, one scale per scaler block (compute dtype), plus the per-tensor scaler
    mean and the 16-level table each process keeps whole."""
    size = scaler_block(rows, cols)
    assert size is not None and quantizable(rows, cols, world)
    numel = rows * cols // world
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + (blocks // size) * compute_itemsize + 17 * compute_itemsize
