"""keel.files: UTF-8 checks that name the line, column and byte offset of the first bad byte."""

from __future__ import annotations

import io

import pytest

from keel.errors import ConfigError, DataError, KeelError
from keel.files import check_utf8, find_utf8_problem, read_text

# The bad byte is on line 3 after "  caf": column 6. Byte offset: "ok\n" (3) + "élan\n"
# (6: é is two bytes) + "  caf" (5) = 14.
LATIN1 = "ok\nélan\n  caf".encode() + b"\xe9" + b" au lait\n"


class Recorder(io.BytesIO):
    """A stream that remembers how much each read asked for."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.sizes: list[int] = []

    def read(self, size=-1):
        self.sizes.append(size)
        return super().read(size)


def test_position_of_a_latin1_byte():
    problem = find_utf8_problem(io.BytesIO(LATIN1))
    assert (problem.offset, problem.line, problem.column) == (14, 3, 6)
    assert problem.bad == b"\xe9" and problem.before == "  caf"
    assert LATIN1[problem.offset] == 0xE9
    assert find_utf8_problem(io.BytesIO(LATIN1.replace(b"\xe9", b"e"))) is None  # control


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 7, 64])
def test_multibyte_characters_split_across_chunks(chunk):
    text = "é中😀\n" * 5 + "end"  # 2-, 3- and 4-byte characters at every offset mod chunk
    stream = Recorder(text.encode())
    assert find_utf8_problem(stream, chunk_bytes=chunk) is None
    assert max(stream.sizes) == chunk  # streamed: never the whole file at once
    bad = (text + "\n").encode() + "xé".encode()[:-1]  # ends inside a character
    problem = find_utf8_problem(io.BytesIO(bad), chunk_bytes=chunk)
    assert (problem.line, problem.column, problem.reason) == (7, 2, "unexpected end of data")
    assert problem.offset == len(bad) - 1
    shifted = b"\xe9" + text.encode()  # a bad byte first, then good ones
    assert find_utf8_problem(io.BytesIO(shifted), chunk_bytes=chunk).offset == 0


def test_bad_byte_inside_a_chunk_after_a_carried_over_sequence():
    data = "中".encode() + b"\xff"  # 3-byte character split by 2-byte chunks, then a bad byte
    problem = find_utf8_problem(io.BytesIO(data), chunk_bytes=2)
    assert (problem.offset, problem.line, problem.column, problem.bad) == (3, 1, 2, b"\xff")


def test_bom_is_accepted_dropped_and_not_counted_as_a_column(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfab\xe9")
    problem = find_utf8_problem(io.BytesIO(path.read_bytes()), chunk_bytes=1)
    assert (problem.offset, problem.line, problem.column) == (5, 1, 3)
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n')
    check_utf8(path, what="data file")  # valid UTF-8: no error
    assert read_text(path, what="data file") == '{"a": 1}\n'


def test_errors_name_the_file_line_column_offset_and_the_fix(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(LATIN1)
    for read in (check_utf8, read_text):
        with pytest.raises(DataError) as err:
            read(path, what="data file", error=DataError, shown="data/d.jsonl")
        message = str(err.value)
        assert message.startswith("data file data/d.jsonl is not UTF-8: line 3, column 6 ")
        assert "byte offset 14" in message and "0xe9" in message
        assert "iconv -f latin1 -t utf-8 data/d.jsonl" in message
    with pytest.raises(ConfigError) as err:  # error: any callable taking the message
        read_text(path, what="config file", error=lambda m: ConfigError([m]))
    assert err.value.problems[0].startswith(f"config file {path} is not UTF-8: line 3")


def test_unreadable_path_is_a_user_error(tmp_path):
    with pytest.raises(KeelError, match="cannot read chat template"):
        read_text(tmp_path, what="chat template")
    with pytest.raises(KeelError, match="cannot read data file"):
        check_utf8(tmp_path / "missing.txt", what="data file")
