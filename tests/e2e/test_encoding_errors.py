"""A file that is not UTF-8, through the CLI: exit 2, the file and line named, no traceback.

Every kind of text file keel reads gets a Latin-1 byte (b"caf\\xe9") on a known line. The
`keel validate` runs go through keel.cli.main in the test process (an interpreter start and
the library imports for each would cost more than the checks; a user error's exit status
through the real program is met in test_cli.py), once in a module-scoped fixture, and are
checked one case per test. A control case holds the same kinds of files with a UTF-8 BOM:
valid UTF-8, so it validates.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_support import keel_in_process

LATIN1 = "caf\xe9".encode("latin-1")
BOM = b"\xef\xbb\xbf"
ROW = b'{"instruction": "ok", "output": "ok"}'


def config(datasets: str, **data: str) -> bytes:
    extra = "".join(f"  {k}: {v}\n" for k, v in data.items())
    stage = "pt" if datasets.endswith(".txt]") else "sft"
    return (
        f"model: {{path: MODEL}}\nmethod: {{type: lora}}\ndata:\n  datasets: {datasets}\n"
        f"  cutoff_len: 64\n{extra}train: {{stage: {stage}, precision: fp32}}\n"
        f"output: {{dir: out}}\n"
    ).encode()


# case: ({file: bytes}, [(a file named in an error, the line of its bad byte)])
CASES = {
    "json": (
        {"d.json": b"[\n  " + ROW + b',\n  {"instruction": "' + LATIN1 + b'", "output": "b"}\n]'},
        [("d.json", 3)],
    ),
    "jsonl": (
        {"d.jsonl": ROW + b'\n{"instruction": "' + LATIN1 + b'", "output": "b"}\n'},
        [("d.jsonl", 2)],
    ),
    "csv": ({"d.csv": b"instruction,output\nok,ok\n" + LATIN1 + b",b\n"}, [("d.csv", 3)]),
    "txt": ({"d.txt": b"first document\n" + LATIN1 + b" document\n"}, [("d.txt", 2)]),
    "folder": (
        {"corpus/a.jsonl": ROW + b"\n", "corpus/b.jsonl": b'{"instruction": "' + LATIN1 + b'"}\n'},
        [("corpus/b.jsonl", 1)],
    ),
    # both are checked before any row is read, and reported together
    "registry_and_template": (
        {
            "lf/d.jsonl": ROW + b"\n",
            "lf/dataset_info.json": b'{\n  "d": {\n    "file_name": "d.jsonl", "note": "'
            + LATIN1
            + b'"\n  }\n}\n',
            "t.jinja": b"{# chat template #}\n{# " + LATIN1 + b" #}\n",
        },
        [("lf/dataset_info.json", 3), ("t.jinja", 2)],
    ),
    "config": ({"d.jsonl": ROW + b"\n"}, [("run.yaml", 5)]),
}
CONFIGS = {
    "json": config("[d.json]"),
    "jsonl": config("[d.jsonl]"),
    "csv": config("[d.csv]"),
    "txt": config("[d.txt]"),
    "folder": config("[corpus]"),
    "registry_and_template": config("[d]", dataset_dir="lf", template="t.jinja"),
    "config": config("[d.jsonl]").replace(b"  cutoff_len", b"  # " + LATIN1 + b"\n  cutoff_len"),
    "bom": config("[d.json, d.jsonl, d.csv]", template="t.jinja"),
}
BOM_FILES = {
    "d.json": BOM + b"[" + ROW + b"]",
    "d.jsonl": BOM + ROW + b"\n",
    "d.csv": BOM + b"instruction,output\nok,ok\n",
    "t.jinja": BOM + b"{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
}


def run_case(case: str, root: Path, model_dir: Path) -> subprocess.CompletedProcess:
    folder = root / case
    files = BOM_FILES if case == "bom" else CASES[case][0]
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "run.yaml").write_bytes(CONFIGS[case].replace(b"MODEL", str(model_dir).encode()))
    return keel_in_process("validate", "run.yaml", "model.cache_dir=cache", cwd=folder)


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("encodings")
    return {case: run_case(case, root, tiny_model_dir) for case in [*CASES, "bom"]}


@pytest.mark.parametrize("case", list(CASES))
def test_non_utf8_file_exits_2_naming_file_and_line(results, case):
    result = results[case]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    messages = [m for m in result.stderr.splitlines() if "is not UTF-8" in m]
    assert len(messages) == len(CASES[case][1]), result.stderr
    for message, (name, line) in zip(messages, CASES[case][1], strict=True):
        assert name in message and f"line {line}, column" in message, message
        assert "byte offset" in message and "iconv -f latin1 -t utf-8" in message


def test_utf8_with_bom_validates(results):
    result = results["bom"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "config and data are valid" in result.stdout
