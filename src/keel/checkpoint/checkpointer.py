"""The Checkpointer: holds a run's stateful parts and saves or restores them together.

Like torchtitan's CheckpointManager, the parts are registered once (the trained module,
optimizer, scheduler, loss scaler, and any extra named part with state_dict() and
load_state_dict()), so the loop calls `save(step, meta)` and resuming calls `load(path)`.
Unlike it, nothing is pickled and every save is an atomic commit (keel.checkpoint.commit):

  the module and optimizer  -> state/ (sharded, keel.checkpoint.dcp)
  scheduler, scaler, extras -> trainer.json (plain JSON; extras under "parts")
  this process's RNGs       -> rng/rank-N.safetensors (keel.checkpoint.rng)
  per-process parts         -> processes/rank-N.json (plain JSON, by part name)

A per-process part holds what differs between processes (grpo's rollout: each process's
block of completions). Its load receives every saved process's state, so that a run
resumed on another number of processes can take its own share.

A checkpoint that lacks the state of a registered extra part is refused, naming the part:
continuing with that part's fresh state would silently not be the run that was saved. A part
registered with missing_ok=True is the exception, for checkpoints written before it was
checkpointed whose fresh state is the saved run's (the dataset's order, a function of the
step and the seed): it keeps its fresh state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError
from torch import nn

from keel.checkpoint.commit import commit_checkpoint, prepare_tmp
from keel.checkpoint.dcp import UnsafeCheckpointError, load_sharded, save_sharded
from keel.checkpoint.layout import (
    CHECKPOINTS,
    PROCESS_DIR,
    RNG_DIR,
    STATE_DIR,
    TRAINER,
    newest_checkpoint,
    process_file_name,
    prune_checkpoints,
    rng_file_name,
    step_dir_name,
    tmp_dir_name,
)
from keel.checkpoint.rng import load_rng, restore_rng, save_rng
from keel.checkpoint.verify import read_json
from keel.distributed.process_group import DistContext
from keel.errors import CheckpointError

_START_OVER = "set train.resume=never to start over, or resume from another checkpoint"


class Stateful(Protocol):
    """A part whose state a checkpoint holds (its state_dict is plain JSON data)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class ProcessStateful(Protocol):
    """A part whose state differs between processes (plain JSON data, or None: nothing to
    save at this step)."""

    def process_state_dict(self) -> dict[str, Any] | None: ...

    def load_process_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """Every saved process's state, in rank order ([] when none saved any)."""
        ...


@dataclass(kw_only=True)
class StatefulParts:
    """What a resumed run needs, beyond its config and data, to continue exactly."""

    module: nn.Module  # what the optimizer trains (the objective around the model)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler; disabled: nothing saved
    extras: dict[str, Stateful] = field(default_factory=dict)  # by name, in trainer.json


@dataclass(frozen=True)
class Restored:
    """What `Checkpointer.load` restored."""

    step: int  # optimizer steps done; also the data position
    scaler_restored: bool  # the fp16 loss scaler's scale and growth tracker were loaded


class Checkpointer:
    """Saves and restores a run's stateful parts as `<output_dir>/checkpoints/step-N`."""

    def __init__(
        self, parts: StatefulParts, *, output_dir: Path, keep_last: int, dist: DistContext
    ):
        self.parts, self.output_dir, self.keep_last, self.dist = parts, output_dir, keep_last, dist
        self.missing_ok: set[str] = set()  # extras that checkpoints may lack (see register)
        self.per_process: dict[str, ProcessStateful] = {}  # see register_per_process
        self.keep_step: int | None = None  # a step whose checkpoint pruning spares (the best)

    @property
    def root(self) -> Path:
        """The folder holding the step folders."""
        return self.output_dir / CHECKPOINTS

    def register(self, name: str, part: Stateful, *, missing_ok: bool = False) -> None:
        """Checkpoint `part` as well, under `name` (saved by the next save, required by load).

        `missing_ok`: a checkpoint without its state (written before this part was saved)
        still loads, and `part` keeps its current state; only for a part whose current state
        is the one the checkpoint's run had (nothing it learned during that run)."""
        assert name not in self.parts.extras, f"a part named {name!r} is already registered"
        self.parts.extras[name] = part
        if missing_ok:
            self.missing_ok.add(name)

    def register_per_process(self, name: str, part: ProcessStateful) -> None:
        """Checkpoint `part`'s state on every process (processes/rank-N.json). A checkpoint
        where no process saved any state for it loads with `part` given []."""
        assert name not in self.per_process, f"a per-process part {name!r} is registered"
        self.per_process[name] = part

    def newest(self) -> Path | None:
        """The newest complete checkpoint of this run's folder (None: none yet)."""
        return newest_checkpoint(self.output_dir)

    def save(self, step: int, meta: dict) -> Path:
        """Write a complete checkpoint for `step` (every process calls this together).

        `meta`: what identifies the run (see keel.checkpoint.identity), written to
        meta.json with the format, the step and the small files' sha256."""
        final, tmp = self.root / step_dir_name(step), self.root / tmp_dir_name(step)
        if self.dist.is_main:
            prepare_tmp(tmp)
        self.dist.barrier()
        save_sharded(tmp / STATE_DIR, self.parts.module, self.parts.optimizer)
        save_rng(tmp / RNG_DIR / rng_file_name(self.dist.rank))
        self._save_process_parts(tmp)
        self.dist.barrier()
        if self.dist.is_main:
            commit_checkpoint(tmp, final, step=step, trainer=self._trainer_record(step), meta=meta)
            prune_checkpoints(self.output_dir, self.keep_last, self.keep_step)
        self.dist.barrier()
        return final

    def _save_process_parts(self, tmp: Path) -> None:
        states = {name: part.process_state_dict() for name, part in self.per_process.items()}
        states = {name: state for name, state in states.items() if state is not None}
        if states:
            folder = tmp / PROCESS_DIR
            folder.mkdir(exist_ok=True)
            (folder / process_file_name(self.dist.rank)).write_text(json.dumps(states))

    def _trainer_record(self, step: int) -> dict:
        scaler = self.parts.scaler
        record = {
            "step": step,
            "scheduler": _plain_scheduler_state(self.parts.scheduler),
            "scaler": (scaler.state_dict() if scaler is not None else None) or {},
        }
        if self.parts.extras:  # absent otherwise: trainer.json as keels before extras wrote it
            record["parts"] = {name: part.state_dict() for name, part in self.parts.extras.items()}
        return record

    def load(self, checkpoint: Path) -> Restored:
        """Restore every part from `checkpoint` (weights and optimizer resharded to this
        run's processes); CheckpointError naming the file and the fix if it cannot be."""
        if not (checkpoint / STATE_DIR).is_dir():
            raise CheckpointError(
                f"{checkpoint} has no {STATE_DIR}/ folder: it was written by an "
                f"older keel or is damaged; set train.resume=never to start over"
            )
        trainer = read_json(checkpoint / TRAINER)
        # First: a part that refuses its state (another data order) stops the load before
        # the weights are read.
        for name, state in self._extra_states(checkpoint, trainer).items():
            self.parts.extras[name].load_state_dict(state)
        _load_module_and_optimizer(checkpoint, self.parts)
        rng = self._read_rng(checkpoint)
        self.parts.scheduler.load_state_dict(trainer["scheduler"])
        scaler_state = trainer.get("scaler") or {}  # absent in checkpoints of older keels
        scaler = self.parts.scaler
        scaler_restored = bool(scaler_state) and scaler is not None and scaler.is_enabled()
        if scaler_restored:
            scaler.load_state_dict(scaler_state)
        self._load_process_parts(checkpoint)
        if rng is not None:
            restore_rng(rng)
        return Restored(step=trainer["step"], scaler_restored=scaler_restored)

    def _extra_states(self, checkpoint: Path, trainer: dict) -> dict[str, dict]:
        """Each registered extra part's saved state; refuses a checkpoint lacking one that
        is not missing_ok. (Saved parts this run does not register are not read.)"""
        saved = trainer.get("parts") or {}
        missing = [n for n in self.parts.extras if n not in saved and n not in self.missing_ok]
        if missing:
            raise CheckpointError(
                f"{checkpoint / TRAINER} holds no state for {', '.join(map(repr, missing))}, "
                f"which this run checkpoints: the checkpoint was written without that part "
                f"(by an older keel, or a run set up differently); {_START_OVER}"
            )
        return {name: saved[name] for name in self.parts.extras if name in saved}

    def _load_process_parts(self, checkpoint: Path) -> None:
        """Each per-process part gets every saved process's state (the files are in rank
        order by name)."""
        if not self.per_process:
            return
        saved = [read_json(f) for f in sorted((checkpoint / PROCESS_DIR).glob("rank-*.json"))]
        for name, part in self.per_process.items():
            part.load_process_state_dicts([states[name] for states in saved if name in states])

    def _read_rng(self, checkpoint: Path) -> dict | None:
        """This rank's saved RNG states (None when it has none: resumed on more processes)."""
        rng_file = checkpoint / RNG_DIR / rng_file_name(self.dist.rank)
        try:
            return load_rng(rng_file) if rng_file.is_file() else None
        except (KeyError, ValueError, OSError, SafetensorError) as exc:
            raise CheckpointError(f"{rng_file} is damaged ({exc}); {_START_OVER}") from None


def _load_module_and_optimizer(checkpoint: Path, parts: StatefulParts) -> None:
    try:
        load_sharded(checkpoint / STATE_DIR, parts.module, parts.optimizer)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(
            f"refusing to load {checkpoint}: {exc}. keel checkpoints hold tensors and plain "
            f"data only, so this one was not written by keel or was altered; nothing in it "
            f"was run. Set train.resume=never to start over"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{exc}; {_START_OVER}") from None


def _plain_scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """The scheduler's state_dict as plain JSON values (trainer.json).

    With torchao's optimizers the last lr is a tensor (their group["lr"] is one); it is
    only reported, never used to compute the next lr, so a float loses nothing.
    """
    return {
        key: [float(v) for v in value] if key == "_last_lr" else value
        for key, value in scheduler.state_dict().items()
    }
