"""Sharded training state with torch.distributed.checkpoint (DCP): a checkpoint's state/.

Each process writes only what it holds (its FSDP2 shards; DDP replicas are de-duplicated),
and loading reshards: a state saved by 2 processes loads into 1, and 1 into 2. Frozen
parameters are left out: they are reloaded from the base model, so a LoRA checkpoint
stays adapter-sized.

Loading unpickles nothing outside an allow-list: DCP itself reads its `.metadata` file with
plain `pickle.load` and optimizer hyperparameters with `torch.load(weights_only=False)`,
either of which would run code from a crafted checkpoint. keel's reader and planner read
them with a restricted unpickler and `weights_only=True` instead.
"""

from __future__ import annotations

import io
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_state_dict,
    set_state_dict,
)

_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def save_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the trainable weights and optimizer state of `module` under `path` (collective)."""
    model_state, optim_state = _trainable_state(module, optimizer)
    with _single_process_is_intended():
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=str(path),
            no_dist=not _distributed(),
        )


def load_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_sharded` wrote into `module` and `optimizer`, resharding as needed.

    Checkpoints of older keels also hold a tied frozen weight (see `_frozen_keys`); it is
    not read."""
    model_state, optim_state = _trainable_state(module, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    _load_allowed(state, path, no_dist=not _distributed())
    # Not strict: frozen parameters are absent by design. A trainable one must not be.
    result = set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    missing = [k for k in result.missing_keys if _strip_wrapper(k) in trainable]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {path} does not match this model: missing trainable "
            f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )


def _trainable_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model and optimizer state dicts without any frozen parameter."""
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    frozen = _frozen_keys(module)
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


def _frozen_keys(module: nn.Module) -> set[str]:
    """The state-dict keys of frozen parameters, under every name each one has.

    `ignore_frozen_params` drops a frozen parameter under its first name only (it walks
    `named_parameters()`, which lists a shared tensor once), so a tied output layer
    (lm_head sharing the frozen embedding) was saved in every LoRA checkpoint: 113 MB
    beside a 19 MB adapter for SmolLM2-135M.
    """
    keys: set[str] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            keys.update(_get_fqns(module, name))
    return keys


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects outside the allow-list."""


def _dcp_metadata_classes() -> dict[tuple[str, str], object]:
    allowed = {
        (dcp_metadata.__name__, name): value
        for name, value in vars(dcp_metadata).items()
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__
    }
    allowed[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = Path
    allowed[("pathlib", "Path")] = Path
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's checkpoint metadata and nothing else: every global it names must be
    one of DCP's metadata classes, torch.Size, a dtype or a layout (what DCP writes)."""

    allowed: dict[tuple[str, str], object] | None = None

    def find_class(self, module: str, name: str):
        if _MetadataUnpickler.allowed is None:
            _MetadataUnpickler.allowed = _dcp_metadata_classes()
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f".metadata holds a pickled object of type "
                f"{module}.{name}, which is not part of a "
                f"checkpoint's metadata"
            )
        return found


def _check_metadata(path: Path) -> None:
    metadata = Path(path) / ".metadata"
    if not metadata.is_file():
        raise ValueError(f"{path} has no .metadata file: the checkpoint is incomplete")
    try:
        _MetadataUnpickler(io.BytesIO(metadata.read_bytes())).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{path}/{exc}") from None
    except Exception as exc:  # truncated or not a pickle at all
        raise ValueError(f"{metadata} is damaged ({type(exc).__name__}: {exc})") from None


def _first_failure(exc: CheckpointException, path: Path) -> Exception:
    failures = [failure for failure, _trace in exc.failures.values()]
    for failure in failures:
        if isinstance(failure, UnsafeCheckpointError | pickle.UnpicklingError):
            return UnsafeCheckpointError(
                f"{path} holds a pickled object that is not plain data ({failure})"
            )
    first = failures[0] if failures else exc
    return ValueError(f"{path} cannot be loaded: {type(first).__name__}: {first}")


class AllowListReader(FileSystemReader):
    """DCP's file reader, with the metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
            except UnsafeCheckpointError as exc:
                raise UnsafeCheckpointError(f"{self.path}: {exc}") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} does not hold checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor values (optimizer hyperparameters) with
    `torch.load(weights_only=True)`: plain numbers, strings and containers only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


@contextmanager
def _single_process_is_intended():
    """DCP warns on every single-process save/load, even when asked for one (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _strip_wrapper(name: str) -> str:
    return name.removeprefix("module.")


def stored_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Shape of every model tensor a `save_sharded` checkpoint holds, by its flattened key
    ("model." + the saved module's parameter name); optimizer entries are left out.

    Reads only the metadata, with the allow-list. Raises UnsafeCheckpointError or
    ValueError (no or damaged .metadata) like `load_sharded`.
    """
    _check_metadata(path)
    metadata = AllowListReader(str(path)).read_metadata()
    return {
        key: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }


def load_model_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Copy stored model tensors into `tensors` (keys as `stored_model_shapes` names them),
    in place and converted to each target's dtype, however many processes saved them.

    For reading weights outside training (export): one process, no module wrapper, and
    the optimizer state is never read. Every key must be in the checkpoint.
    """
    _load_allowed(tensors, path, no_dist=True)


def _load_allowed(state: dict, path: Path, *, no_dist: bool) -> None:
    """DCP-load `path` into `state` in place through the allow-list: nothing unpickled."""
    _check_metadata(path)  # before DCP, whose own errors would hide the reason
    with _single_process_is_intended():
        try:
            dcp.load(
                state,
                storage_reader=AllowListReader(str(path)),
                planner=WeightsOnlyLoadPlanner(),
                no_dist=no_dist,
            )
        except CheckpointException as exc:  # DCP gathers every rank's failure into one
            raise _first_failure(exc, path) from None
