"""Check a model folder's safetensors files against their own headers before reading them.

A safetensors file is a little-endian u64 header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the tensor bytes. A file cut short (an
interrupted download or copy, a full disk) still has its whole header, so a reader that
trusts the header reads past the end: positioned reads come back short and, unchecked,
leave zeros where weights should be (a run "trains" on them and exits 0). Every tensor's
byte range is checked against the file's size here, before anything is loaded, and the
error names the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from keel.errors import ModelError

INDEX = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what PEFT saves
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}
_ITEM_BYTES |= {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4}
_FIX = "the file is damaged or incomplete (an interrupted download or copy?): fetch it again"


@dataclass(frozen=True)
class SafetensorsFile:
    """One checked file: where its tensor bytes start and its header (no __metadata__)."""

    path: Path
    data_start: int
    tensors: dict[str, dict]


def read_checked(path: Path) -> SafetensorsFile:
    """The header of the safetensors file at `path`; ModelError naming the file (and the
    tensor) when the header cannot be read or a tensor's bytes lie past the end of the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ModelError(f"{path} is {size} bytes, too short to be safetensors; {_FIX}")
            header_len = struct.unpack("<Q", head)[0]
            if 8 + header_len > size:
                raise ModelError(
                    f"{path}: its header says {header_len} bytes but the file has {size}; {_FIX}"
                )
            header = json.loads(handle.read(header_len))
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: its header is not valid JSON ({exc}); {_FIX}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: its header is not a JSON object; {_FIX}")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    ends = {key: _check_tensor(path, key, info, data_start) for key, info in header.items()}
    cut = sorted((end, key) for key, end in ends.items() if end > size)
    if cut:
        end, key = cut[0]
        begin = data_start + int(header[key]["data_offsets"][0])
        raise ModelError(
            f"{path} is truncated: it has {size} bytes but its header needs "
            f"{max(ends.values())}; {len(cut)} of its {len(ends)} tensors lie past the end, "
            f"the first tensor {key} (bytes {begin} to {end}); {_FIX}"
        )
    return SafetensorsFile(path, data_start, header)


def _check_tensor(path: Path, key: str, info, data_start: int) -> int:
    """Where the tensor's bytes end in the file, once its header entry is found sound."""
    try:
        begin, end = (int(x) for x in info["data_offsets"])
        shape, dtype = [int(n) for n in info["shape"]], info["dtype"]
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{path}: tensor {key} has a malformed header entry; {_FIX}") from None
    if not 0 <= begin <= end:
        raise ModelError(f"{path}: tensor {key} has data_offsets {[begin, end]}; {_FIX}")
    item = _ITEM_BYTES.get(dtype)
    if item is not None and end - begin != math.prod(shape) * item:
        raise ModelError(
            f"{path}: tensor {key} ({dtype} {shape}) should take "
            f"{math.prod(shape) * item} bytes, its header gives it {end - begin}; {_FIX}"
        )
    return data_start + end


def model_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder: those its index names, else every
    *.safetensors in it. A file the index names must exist."""
    index = model_dir / INDEX
    if not index.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{index} cannot be read ({exc!r}); {_FIX}") from None
    missing = [name for name in names if not (model_dir / name).is_file()]
    if missing:
        raise ModelError(
            f"{index} names {len(missing)} file(s) that are not in {model_dir} "
            f"(e.g. {missing[0]}); {_FIX}"
        )
    return [model_dir / name for name in names]


def check_model_dir(model_dir: Path) -> list[SafetensorsFile]:
    """Every safetensors file of `model_dir`, checked (see `read_checked`); with an index,
    each tensor it maps must be in the file it names. [] when the folder has none."""
    files = [read_checked(path) for path in model_files(model_dir)]
    index = model_dir / INDEX
    if index.is_file():
        held = {f.path.name: f.tensors for f in files}
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for key, name in weight_map.items():
            if key not in held[name]:
                raise ModelError(
                    f"{index} puts tensor {key} in {model_dir / name}, which does not hold "
                    f"it; {_FIX}"
                )
    return files
