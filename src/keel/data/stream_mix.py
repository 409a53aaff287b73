"""Streamed datasets mixed (data.mix interleave_* with data.streaming): each block of rows is
drawn from every dataset at once, so a step's rows come from all of them.

A block takes BLOCK_ROWS rows: with data.mix_weights, a seeded multinomial draw says how
many come from each dataset, else an equal share each (in turn). Each dataset reads on from
where it stopped (`Position`: its pass over its files, each pass in an order drawn from
train.seed; the file; the rows of it read). The rows are encoded by their dataset's
encoder, then the block's samples are cut, packed and shuffled together as a streamed
block is (keel.data.stream). When a dataset runs out, the mix says what follows, as
LLaMA-Factory's mix_strategy does for streamed datasets: `interleave_under` ends the epoch
(every dataset starts again); `interleave_over` reads it again, and the epoch ends once
each has run out; `interleave_once` draws from the others only, and the epoch ends once
each has run out. The position is a `MixCursor`, checkpointed: a resume reads the block it
points into again, from each dataset's position at that block's start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np
import pyarrow as pa

from keel.data import stream
from keel.data.batching import epoch_order
from keel.data.stream import StreamedData, StreamFile, block_seed
from keel.errors import DataError


@dataclass(frozen=True)
class Position:
    """Where one dataset's rows continue: its `passes`-th pass over its files this epoch,
    the `file`-th file of that pass's order, `row` raw rows of it read."""

    passes: int = 0
    file: int = 0
    row: int = 0


@dataclass(frozen=True)
class MixCursor:
    """`row` rows taken of block `block` of epoch `epoch`; `at` and `done`: each dataset's
    position when that block starts, and whether it ran out earlier in the epoch (empty:
    every dataset at its start)."""

    epoch: int = 0
    block: int = 0
    row: int = 0
    at: tuple[Position, ...] = ()
    done: tuple[bool, ...] = ()

    @classmethod
    def from_state(cls, state: dict) -> MixCursor:
        at = tuple(Position(**p) for p in state["at"])
        return cls(state["epoch"], state["block"], state["row"], at, tuple(state["done"]))


@dataclass(frozen=True)
class _Made:
    rows: pa.Table  # the block's rows
    at: tuple[Position, ...]  # each dataset's position after it
    done: tuple[bool, ...]
    epoch_over: bool  # the next block starts the next epoch


class MixedRowStream:
    """The rows of a `StreamedData` whose datasets are mixed, from a `MixCursor` on."""

    def __init__(self, data: StreamedData, log: Callable[[str], None]):
        self.data, self.log = data, log
        entries = sorted({f.source for f in data.files})
        self.files = [[f for f in data.files if f.source == k] for k in entries]
        weights = data.making.mix_weights
        self.weights = [weights[k] for k in entries] if weights else None
        self.cursor = MixCursor()
        self._made: _Made | None = None
        # per dataset: (the position it stands at, its file's reader, rows read ahead)
        self._readers: dict[int, tuple[Position, Iterator, dict[str, list]]] = {}
        self._epoch_rows = 0

    def state(self) -> dict:
        return {"mix": True, **asdict(self.cursor)}

    def seek_state(self, state: dict) -> None:
        if not state.get("mix"):
            raise DataError(
                "the checkpoint's stream read its datasets one after another (data.mix "
                "concat), and this run mixes them; resume with its data.mix, or set "
                "train.resume=never to start over"
            )
        self.cursor, self._made, self._readers = MixCursor.from_state(state), None, {}
        self._epoch_rows = 1  # resumed inside an epoch that gave rows before

    def take(self, count: int) -> list[dict]:
        """The next `count` rows (moving on to the next epoch where the mix says so)."""
        out: list[dict] = []
        while len(out) < count:
            if self._made is None:
                self._made = self._make(self.cursor)
            made, c = self._made, self.cursor
            taken = made.rows.slice(c.row, count - len(out)).to_pylist()
            out += taken
            self._epoch_rows += len(taken)
            if c.row + len(taken) < made.rows.num_rows:
                self.cursor = replace(c, row=c.row + len(taken))
                continue
            self._made = None
            if not made.epoch_over:
                self.cursor = MixCursor(c.epoch, c.block + 1, 0, made.at, made.done)
                continue
            if not self._epoch_rows:
                raise DataError(
                    "no usable samples in the streamed training data: every row of the "
                    "mixed datasets was dropped or rejected"
                )
            self.cursor, self._epoch_rows, self._readers = MixCursor(c.epoch + 1), 0, {}
        return out

    def progress(self) -> float:
        """Epochs read, counting the files each dataset started this epoch (on average)."""
        at = self.cursor.at or tuple(Position() for _ in self.files)
        started = [min(p.file / len(f), 1.0) for p, f in zip(at, self.files, strict=True)]
        return self.cursor.epoch + sum(started) / len(started)

    def _make(self, c: MixCursor) -> _Made:
        """Block `c.block` of epoch `c.epoch`: each dataset's share read on from `c.at`."""
        at = list(c.at or [Position() for _ in self.files])
        done = list(c.done or [False for _ in self.files])
        mix, units, ran_out = self.data.making.mix, [], False
        for k, wanted in enumerate(self._counts(c, done)):
            got, restarted = 0, False
            while got < wanted:
                piece = self._read(k, c.epoch, at[k], wanted - got)
                if piece is None:  # its pass is over
                    done[k] = True
                    if mix != "interleave_over":  # under: the epoch ends; once: no more
                        ran_out |= mix == "interleave_under"
                        break
                    if restarted and got == 0:
                        raise DataError(f"{self.files[k][0].label}: its dataset has no rows")
                    at[k], restarted = Position(passes=at[k].passes + 1), True
                    continue
                file, raw, numbers, at[k] = piece
                got += len(numbers)
                if numbers:
                    units.append(stream.encode_units(self.data, file, raw, numbers, self.log))
        table = pa.concat_tables(units) if units else stream.UNITS.empty_table()
        seed = block_seed(self.data.making.seed, c.epoch, c.block, 0)
        rows = stream.make_block_rows(self.data.making, table, seed)
        return _Made(rows, tuple(at), tuple(done), ran_out or all(done))

    def _counts(self, c: MixCursor, done: list[bool]) -> list[int]:
        """How many raw rows each dataset gives block `c.block`: a seeded multinomial draw
        by the weights, else equal shares; none from a dataset interleave_once used up."""
        rows = stream.BLOCK_ROWS  # read here: tests make blocks small
        drawn = [not (d and self.data.making.mix == "interleave_once") for d in done]
        active = [k for k, on in enumerate(drawn) if on]
        counts = [0] * len(self.files)
        if not active:
            return counts
        if self.weights is None:
            share, extra = divmod(rows, len(active))
            shares = [share + (i < extra) for i in range(len(active))]
        else:
            p = np.array([self.weights[k] for k in active], dtype=np.float64)
            if p.sum() <= 0:  # only zero-weight datasets are left
                return counts
            rng = np.random.default_rng(block_seed(self.data.making.seed, c.epoch, c.block, 1))
            shares = rng.multinomial(rows, p / p.sum()).tolist()
        for k, share in zip(active, shares, strict=True):
            counts[k] = share
        return counts

    def _order(self, k: int, epoch: int, passes: int) -> list[int]:
        """Dataset k's files in the order of its pass `passes` of epoch `epoch`."""
        making = self.data.making
        seed = block_seed(making.seed, passes, 2 + k)
        return epoch_order(len(self.files[k]), epoch, seed, making.shuffle)

    def _read(self, k: int, epoch: int, at: Position, wanted: int):
        """Up to `wanted` raw rows of dataset k from `at`: (file, rows as columns, their
        1-based numbers, the position after them); no rows where the file ends (the
        position moves to the next file); None when the pass is over."""
        order = self._order(k, epoch, at.passes)
        if at.file >= len(order):
            return None
        file: StreamFile = self.files[k][order[at.file]]
        held = self._readers.get(k)
        if held is None or held[0] != at:
            held = (at, stream.reader(file, at.row), {})
        _, rows, ahead = held
        if not ahead or not len(next(iter(ahead.values()))):
            ahead = stream.read_block(file, rows, at.row) or {}
            if not ahead:
                self._readers.pop(k, None)
                return file, {}, [], Position(at.passes, at.file + 1, 0)
        size = min(wanted, len(next(iter(ahead.values()))))
        raw = {key: values[:size] for key, values in ahead.items()}
        after = Position(at.passes, at.file, at.row + size)
        self._readers[k] = (after, rows, {key: values[size:] for key, values in ahead.items()})
        return file, raw, list(range(at.row + 1, at.row + size + 1)), after
