"""data.max_row_bytes: a row larger than the limit is refused by file and line before any
parser holds it (one 200 MB JSONL line once took a process to 16.5 GB), in bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from keel.cli import main
from keel.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
ROW = {"instruction": "Who are you?", "input": "", "output": "I am Keel."}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def big_row(size: int) -> dict:
    return {**ROW, "output": "x" * size}


def check(path: Path, kind: str, limit: int) -> None:
    from keel.data.row_size import check_row_sizes

    check_row_sizes(path, path.name, kind, limit)


def test_a_jsonl_line_over_the_limit_is_named_by_line(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [ROW, ROW, big_row(5000), ROW])
    with pytest.raises(DataError) as info:
        check(path, "json", 4096)
    message = str(info.value)
    assert message.startswith("d.jsonl: line 3 is larger than data.max_row_bytes = 4096")
    assert "data.max_row_bytes=8192" in message
    check(path, "json", 8192)  # raised, it passes


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_line_numbers_and_lengths_hold_across_chunk_borders(tmp_path, monkeypatch, chunk):
    from keel.data import row_size

    monkeypatch.setattr(row_size, "CHUNK_BYTES", chunk)
    lines = ["a" * 30, "", "b" * 100, "d" * 5]
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines) + "\n")
    check(path, "text", 100)  # a 100-byte line is within a 100-byte limit...
    path.write_text("\n".join([*lines[:3], "c" * 101, *lines[3:]]))
    with pytest.raises(DataError, match="t.txt: line 4 is larger"):
        check(path, "text", 100)  # ...the 101-byte one is not
    path.write_text("x" * 101)  # no newline at all
    with pytest.raises(DataError, match="t.txt: line 1 is larger"):
        check(path, "text", 100)


def test_a_json_array_is_checked_element_by_element(tmp_path):
    """A minified array is one long line of small rows (json.dump's default): fine. One
    element over the limit is named by its position, pretty-printed or not."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROW] * 500))  # ~35 kB on one line
    check(path, "json", 4096)
    path.write_text(json.dumps([ROW, big_row(5000), ROW], indent=2))
    with pytest.raises(DataError, match="d.json: element 2 of its JSON array is larger"):
        check(path, "json", 4096)
    path.write_text('\ufeff [1, 2.5, {"a": [3]}, "s" , null]')  # BOM, numbers, spaces
    check(path, "json", 16)


def test_a_huge_line_is_refused_without_reading_it_into_memory(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [ROW, big_row(24 * 2**20)])
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="line 2 is larger"):
            check(path, "json", 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # a 1 MiB limit, a 24 MiB line


def test_a_huge_json_element_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROW, big_row(24 * 2**20)]))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="element 2 of its JSON array"):
            check(path, "json", 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


def test_validate_refuses_the_row_naming_file_line_and_key(tiny_model_dir, tmp_path, capsys):
    data = jsonl(tmp_path / "big.jsonl", [ROW] * 3 + [big_row(3000)] + [ROW] * 3)
    args = [
        "validate",
        str(ROOT / "examples" / "identity_lora.yaml"),
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"data.datasets.0.path={data}",
        f"output.dir={tmp_path / 'out'}",
    ]
    assert main([*args, "data.max_row_bytes=2048"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "big.jsonl: line 4 is larger than data.max_row_bytes = 2048" in err, err
    assert main([*args, "data.max_row_bytes=4096"]) == 0, capsys.readouterr().err
