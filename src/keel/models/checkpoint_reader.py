"""Read tensors, or row ranges of them, from a safetensors model folder."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from keel.errors import ModelError
from keel.models.checkpoint_names import StackedExperts
from keel.models.mxfp4 import Mxfp4Experts
from keel.models.safetensors_files import check_model_dir

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReader:
    """Reads tensors, or row ranges of them, from a safetensors model directory.

    Plain positioned reads rather than a memory map: mapped file pages count in a process's
    resident memory, so reading through a map would make every rank look as if it held the
    whole checkpoint. The format is a little-endian u64 header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the row-major tensor bytes.
    """

    def __init__(self, model_dir: Path):
        checked = check_model_dir(model_dir)  # every tensor's bytes are inside its file
        if not checked:
            raise ModelError(
                f"{model_dir} holds no *.safetensors weights; keel trains from "
                f"safetensors (convert with save_pretrained(safe_serialization=True))"
            )
        self._stack = ExitStack()
        self._where: dict[str, tuple[object, int, dict]] = {}
        for file in checked:
            handle = self._stack.enter_context(open(file.path, "rb"))
            for key, info in file.tensors.items():
                if info["dtype"] not in _SAFETENSORS_DTYPES:
                    raise ModelError(
                        f"{file.path}: tensor {key} has dtype "
                        f"{info['dtype']}, which keel cannot train from"
                    )
                self._where[key] = (handle, file.data_start, info)
        # fused expert tensors built from other tensors (per-expert ones, MXFP4 blocks)
        self._stacked: dict[str, StackedExperts | Mxfp4Experts] = {}
        self.model_dir = model_dir

    def add_stacked(self, stacked: dict[str, StackedExperts | Mxfp4Experts]) -> None:
        """Read these names as experts stacked from their per-expert tensors, or dequantized
        from MXFP4 blocks and scales."""
        self._stacked.update(stacked)

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...] | None:
        if key in self._stacked:
            return self._stacked[key].shape(self.shape)
        found = self._where.get(key)
        return None if found is None else tuple(found[2]["shape"])

    def get(self, key: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `key`, or only `region` of it (rows read from disk without the rest)."""
        if key in self._stacked:
            return self._stacked[key].read(self, region)
        handle, data_start, info = self._where[key]
        shape, dtype = list(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        rows = slice(0, shape[0] if shape else 1)
        if (
            region is not None
            and shape
            and all(r == slice(0, n) for r, n in zip(region[1:], shape[1:]))
        ):
            rows, region = region[0], None  # a range of rows is one contiguous byte range
        row_bytes = (end - begin) // max(shape[0], 1) if shape else end - begin
        count = rows.stop - rows.start
        buffer = bytearray(count * row_bytes)
        handle.seek(data_start + begin + rows.start * row_bytes)
        _read_exactly(handle, buffer, key)
        flat = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
        tensor = flat.reshape([count, *shape[1:]] if shape else [])
        return tensor if region is None else tensor[region]

    def close(self) -> None:
        self._stack.close()


def _read_exactly(handle, buffer: bytearray, key: str) -> None:
    """Fill `buffer` from `handle`; a short read (the file shrank after it was checked)
    is an error, never zeros left in the weights."""
    view, done = memoryview(buffer), 0
    while done < len(buffer):
        got = handle.readinto(view[done:])
        if not got:
            raise ModelError(
                f"{handle.name}: reading tensor {key} ended after {done} of {len(buffer)} "
                f"bytes: the file is shorter than its header says (truncated or changed "
                f"while keel read it); fetch it again"
            )
        done += got
