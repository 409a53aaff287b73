"""Refuse a data row larger than `data.max_row_bytes` before any parser holds it.

`datasets` parses a JSONL file in blocks that grow until a whole line fits, and the row then
goes through formatting and the tokenizer: one 200 MB line took a process to 16.5 GB and
the kernel's OOM killer. The file is scanned here first, in bounded pieces: a line (JSONL,
CSV, text) or an element of a JSON array longer than the limit is a DataError naming the
file, the line or element, and the key to raise; memory stays within about twice the limit.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import BinaryIO

from keel.errors import DataError
from keel.files import open_binary

CHUNK_BYTES = 1 << 20
KEY = "data.max_row_bytes"


def check_row_sizes(path: Path, label: str, kind: str, limit: int) -> None:
    """DataError when a row of the text data file at `path` holds more than `limit` bytes.

    kind: the loader ("json", "csv", "text"); a .json file that starts with `[` is checked
    element by element, any other text file line by line.
    """
    with open_binary(path) as stream:  # decompressed (.jsonl.gz, ...): rows are its lines
        head = stream.read(CHUNK_BYTES).removeprefix(codecs.BOM_UTF8).lstrip()
        if kind == "json" and head.startswith(b"["):
            _check_array(stream, head[1:], label, limit)
            return
    with open_binary(path) as stream:  # again from the start (a codec's stream cannot seek)
        _check_lines(stream, label, limit)


def _too_large(label: str, what: str, limit: int) -> DataError:
    mib = f" ({limit / 2**20:g} MiB)" if limit >= 2**20 else ""
    return DataError(
        f"{label}: {what} is larger than {KEY} = {limit} bytes{mib}, the most a row may "
        f"hold: reading it would take many times that in memory. Fix or "
        f"remove that row, or raise the limit if the row is meant ({KEY}={2 * limit})"
    )


def _check_lines(stream: BinaryIO, label: str, limit: int) -> None:
    """Line lengths from chunk.find/rfind/count (C speed): a line that starts and ends in
    one chunk of at most `limit` bytes is within the limit, so only the lines crossing
    chunk borders are measured."""
    size = min(CHUNK_BYTES, limit)
    current, line = 0, 1  # bytes of the line being read so far, its 1-based number
    while chunk := stream.read(size):
        first = chunk.find(b"\n")
        if first < 0:
            current += len(chunk)
        else:
            if current + first > limit:
                break
            line += chunk.count(b"\n")
            current = len(chunk) - chunk.rfind(b"\n") - 1
        if current > limit:
            break
    else:
        return
    raise _too_large(label, f"line {line}", limit)


def _check_array(stream: BinaryIO, head: bytes, label: str, limit: int) -> None:
    """Each element of a JSON array (`head`: the bytes read after its `[`), decoded one at
    a time from a window that never grows much past `limit` beyond the element's start."""
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")("replace")
    text, pos, index, eof = utf8.decode(head), 0, 0, False
    while True:
        pos = _skip_separators(text, pos)
        if pos < len(text) and text[pos] == "]":
            return
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            end = None
        except RecursionError:  # nested past Python's limit: the JSON loader reports it
            return
        if end is not None and (end < len(text) or eof):  # a number may go on: read on
            index += 1
            if end - pos > limit // 4 and len(text[pos:end].encode()) > limit:
                raise _too_large(label, f"element {index} of its JSON array", limit)
            pos = end
            continue
        if eof:  # malformed, or a cut-off last element: the JSON loader reports it
            return
        if len(text) - pos > limit:
            raise _too_large(label, f"element {index + 1} of its JSON array", limit)
        piece = stream.read(max(CHUNK_BYTES, len(text) - pos))  # grows: no quadratic re-parse
        eof = not piece
        text = text[pos:] + utf8.decode(piece, final=eof)
        pos = 0


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n,":
        pos += 1
    return pos
