"""How torchao's 8/4-bit AdamW stores its moments, and how many bytes that takes.

Pure arithmetic (no torchao), shared by keel.train.optim (which builds the optimizer and
logs what it holds) and the memory planner, so that `keel plan` counts what training
allocates (tested against torchao's own buffers).

AdamW8bit / AdamW4bit (torchao.optim) keep each moment (exp_avg, exp_avg_sq) of a tensor
as codes (one byte per value, or two 4-bit values per byte) into a code book, in blocks of
`block_size` values that share one fp32 scale (the block's absmax); each quantised moment
carries its own fp32 code book (`qmap`). The 8-bit books are dynamic maps of 256 entries
(signed for exp_avg, unsigned for exp_avg_sq); the 4-bit ones have 16 entries (a dynamic
map for exp_avg, a linear one without zero for exp_avg_sq); both moments share the block
size. Following bitsandbytes, a tensor is quantised only when its local tensor (this
process's shard under FSDP2: torchao decides on `DTensor.to_local()`) has at least 4096
values and a whole number of blocks; otherwise its moments are plain tensors in the
parameter's dtype (torchao.optim.adam._AdamBase._new_buffer; pytorch/ao#4912).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_NUMEL = 4096  # smaller local tensors keep full-precision moments
STEP_BYTES = 4  # the step count, an fp32 scalar tensor per parameter


@dataclass(frozen=True)
class LowBitAdamW:
    """One of torchao's block-quantised AdamW variants, at torchao's default block size."""

    cls: str  # in torchao.optim
    bits: int  # per moment value
    block_size: int  # values sharing one fp32 scale
    qmap_len: int  # fp32 entries of each quantised moment's code book

    def quantised(self, local_numel: int) -> bool:
        """Whether torchao quantises the moments of a local tensor of `local_numel` values."""
        return local_numel >= MIN_NUMEL and local_numel % self.block_size == 0

    def moment_bytes(self, local_numel: int, itemsize: int) -> int:
        """Bytes of one moment of a local tensor (`itemsize`: the parameter's, when kept)."""
        if not self.quantised(local_numel):
            return local_numel * itemsize
        codes = local_numel * self.bits // 8
        return codes + 4 * (local_numel // self.block_size) + 4 * self.qmap_len


LOW_BIT = {
    "adamw_8bit": LowBitAdamW(cls="AdamW8bit", bits=8, block_size=256, qmap_len=256),
    "adamw_4bit": LowBitAdamW(cls="AdamW4bit", bits=4, block_size=128, qmap_len=16),
}


def adamw_state_bytes(optimizer: str, local_numel: int, itemsize: int) -> int:
    """Bytes of AdamW's state for one parameter: two moments and the step.

    `optimizer`: train.optimizer (adamw keeps both moments in the parameter's dtype);
    `local_numel`: the values this process holds (its unpadded shard under FSDP2).
    """
    low = LOW_BIT.get(optimizer)
    moment = local_numel * itemsize if low is None else low.moment_bytes(local_numel, itemsize)
    return 2 * moment + STEP_BYTES
