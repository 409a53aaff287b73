"""Reading the user's text files as UTF-8, with errors that say where the first bad byte is.

Every text file keel reads (data files, `dataset_info.json`, `.jinja` templates, the run
config) must be UTF-8. A file that is not (typically Latin-1 or cp1252 saved by an old
editor or a spreadsheet) is a user error naming the file, the line, the column and the byte
offset of the first byte that cannot be decoded, and how to convert the file.

A UTF-8 byte order mark (BOM, EF BB BF) at the start of a file is valid UTF-8 and accepted:
`read_text` drops it, as Python's `utf-8-sig` codec and the JSON/CSV loaders of `datasets`
do, so it never reaches a parser or a training sample.

A file whose last suffix names a compression (`.gz`, `.bz2`, `.xz`, `.zst`: corpora are
published so, `c4-train.00000-of-01024.json.gz`) is read decompressed, as `datasets` reads
it; a damaged one is an error naming the file.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from keel.errors import KeelError

CHUNK_BYTES = 1 << 20  # streamed in 1 MiB pieces: a multi-GB corpus is never held in memory
_CONTEXT_CHARS = 30  # text shown before the bad byte
ErrorType = Callable[[str], Exception]
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def open_binary(path: Path) -> BinaryIO:
    """The file's bytes, decompressed when its last suffix is one of COMPRESSIONS."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".zst":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(
            path.open("rb"), read_across_frames=True, closefd=True
        )
        return io.BufferedReader(reader, CHUNK_BYTES)
    return path.open("rb")


def read_errors() -> tuple[type[Exception], ...]:
    """What reading a file through `open_binary` raises for a file that cannot be read or
    decompressed (a truncated or damaged archive)."""
    import zstandard

    return (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError)


@dataclass(frozen=True)
class Utf8Problem:
    """Where a file stops being valid UTF-8."""

    offset: int  # 0-based byte offset of the first bad byte
    line: int  # 1-based
    column: int  # 1-based, in characters (a leading BOM is not counted)
    bad: bytes  # the bytes that cannot be decoded (at most 4)
    reason: str  # the codec's reason, e.g. "invalid continuation byte"
    before: str  # up to _CONTEXT_CHARS characters before it on the same line


class _Position:
    """Line, column and recent text of a stream of decoded text."""

    def __init__(self) -> None:
        self.line, self.column, self.tail, self.started = 1, 1, "", False

    def feed(self, text: str) -> None:
        if not text:
            return
        if not self.started:  # a BOM is invisible in editors: do not count it as a column
            self.started = True
            text = text.removeprefix("\ufeff")
        newlines = text.count("\n")
        if newlines:
            self.line += newlines
            last = text[text.rfind("\n") + 1 :]
            self.column, self.tail = len(last) + 1, last[-_CONTEXT_CHARS:]
        else:
            self.column += len(text)
            self.tail = (self.tail + text[-_CONTEXT_CHARS:])[-_CONTEXT_CHARS:]


def find_utf8_problem(stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> Utf8Problem | None:
    """The first byte of `stream` that is not valid UTF-8, or None; reads it in chunks.

    A multi-byte character split across two chunks is carried over to the next one
    (`utf_8_decode` with final=False stops before an incomplete sequence at the end).
    """
    position, offset, carry = _Position(), 0, b""  # offset: where `carry` starts in the file
    while True:
        chunk = stream.read(chunk_bytes)
        data, final = carry + chunk, not chunk
        try:
            text, used = codecs.utf_8_decode(data, "strict", final)
        except UnicodeDecodeError as e:
            position.feed(data[: e.start].decode("utf-8"))
            return Utf8Problem(
                offset=offset + e.start,
                line=position.line,
                column=position.column,
                bad=data[e.start : min(e.end, e.start + 4)],
                reason=e.reason,
                before=position.tail,
            )
        position.feed(text)
        if final:
            return None
        carry, offset = data[used:], offset + used


def describe(problem: Utf8Problem, shown: str, what: str) -> str:
    """The error message: the file, where the bad byte is, and how to convert the file."""
    bad = " ".join(f"0x{b:02x}" for b in problem.bad)
    after = f", after {problem.before!r}" if problem.before else ""
    return (
        f"{what} {shown} is not UTF-8: line {problem.line}, column {problem.column} "
        f"(byte offset {problem.offset}{after}) holds byte(s) {bad} that cannot be decoded "
        f"({problem.reason}). keel reads text files as UTF-8: re-save the file as UTF-8, e.g. "
        f"`iconv -f latin1 -t utf-8 {shown} > utf8-copy` when it is Latin-1 (use cp1252 for "
        f"files from Windows), then point the config at the copy"
    )


def check_utf8(
    path: str | Path, *, what: str, error: ErrorType = KeelError, shown: str | None = None
) -> None:
    """Raise `error(message)` when the file at `path` is not UTF-8; reads it in chunks.

    what: what the file is, for the message ("data file", "chat template", ...).
    shown: how the message names the file (default: the path as given).
    """
    path = Path(path)
    try:
        with open_binary(path) as f:
            problem = find_utf8_problem(f)
    except read_errors() as e:
        raise error(f"cannot read {what} {shown or path}: {_reason(e)}") from None
    if problem is not None:
        raise error(describe(problem, shown or str(path), what))


def read_text(
    path: str | Path, *, what: str, error: ErrorType = KeelError, shown: str | None = None
) -> str:
    """The file's text, decoded as UTF-8 with a leading BOM dropped.

    Raises `error(message)` naming the file, line, column and byte offset when it is not
    UTF-8, or when it cannot be read. For files small enough to hold in memory (configs,
    templates, registries); stream large data files with `check_utf8`.
    """
    path = Path(path)
    try:
        with open_binary(path) as f:
            data = f.read()
    except read_errors() as e:
        raise error(f"cannot read {what} {shown or path}: {_reason(e)}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        problem = find_utf8_problem(io.BytesIO(data))
        assert problem is not None, "decode failed, so the scan finds the bad byte"
        raise error(describe(problem, shown or str(path), what)) from None
    return text.removeprefix("\ufeff")


def _reason(exc: Exception) -> str:
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if isinstance(exc, EOFError):  # gzip, bz2, xz: the stream ends inside a block
        return f"it ends early (a truncated archive?): {reason}"
    return reason


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under root (and root itself) to disk."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
