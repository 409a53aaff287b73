"""Sources: every file kind, folders, saved datasets, malformed JSON, dataset_info.json."""

from __future__ import annotations

import json

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import DataError

ALPACA = [
    {"instruction": "Who are you?", "input": "", "output": "I am Keel."},
    {"instruction": "Translate to French:", "input": "hello world", "output": "Bonjour le monde."},
    {"instruction": "Give three tips", "input": "", "output": "Eat well, sleep, move."},
]
MESSAGES = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }
    for i in range(4)
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prepare(tiny_tokenizer, tmp_path):
    """prepare(*datasets, stage=, **data) in tmp_path; returns (PreparedData, decoded train rows)."""

    def run(*datasets, stage="sft", **data):
        configs = [d if isinstance(d, DatasetConfig) else DatasetConfig(path=d) for d in datasets]
        prepared = prepare_data(
            DataConfig(datasets=configs, **data),
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda s: None,
        )
        return prepared, [tiny_tokenizer.decode(r["input_ids"]) for r in prepared.train]

    return run


def test_csv(tmp_path, prepare):
    import csv

    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(ALPACA)
    _, texts = prepare("d.csv")
    assert len(texts) == 3 and "Bonjour le monde." in texts[1] and "hello world" in texts[1]


def test_parquet_with_nested_messages(tmp_path, prepare):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(MESSAGES), tmp_path / "d.parquet")
    _, texts = prepare("d.parquet")
    assert [t.count("answer") for t in texts] == [1, 1, 1, 1]
    assert "answer 3" in texts[3]


def test_json_array(tmp_path, prepare):
    (tmp_path / "d.json").write_text(json.dumps(ALPACA, indent=2))
    data, _ = prepare("d.json")
    assert len(data.train) == 3 and data.report.files[0].read == 3


def test_save_to_disk_dataset_and_dataset_dict(tmp_path, prepare):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "saved"))
    assert len(prepare("saved")[0].train) == 3
    DatasetDict(
        {"train": Dataset.from_list(ALPACA), "test": Dataset.from_list(ALPACA[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(prepare(DatasetConfig(path="dd", split="test"))[0].train) == 1
    with pytest.raises(DataError, match="no split 'dev'; available: train, test"):
        prepare(DatasetConfig(path="dd", split="dev"))


def test_text_file_for_pretraining_skips_blank_lines(tmp_path, prepare):
    (tmp_path / "corpus.txt").write_text("The quick brown fox.\n\nThe lazy dog.\n")
    data, texts = prepare("corpus.txt", stage="pt")
    assert texts == ["The quick brown fox.<|im_end|>", "The lazy dog.<|im_end|>"]
    for row in data.train:  # pretraining: every next token is a target
        assert row["targets"] == row["input_ids"][1:] + [-100]


def test_folder_of_files_reports_each_file(tmp_path, prepare):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ALPACA[:2])
    write_jsonl(folder / "b.jsonl", ALPACA[2:])
    (folder / "dataset_info.json").write_text("{}")  # a registry is not data
    (folder / "notes.md").write_text("ignored")
    data, _ = prepare("folder")
    assert [(f.file, f.read, f.kept) for f in data.report.files] == [
        ("folder/a.jsonl", 2, 2),
        ("folder/b.jsonl", 1, 1),
    ]


def test_max_samples_caps_rows_across_files(tmp_path, prepare):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ALPACA[:2])
    write_jsonl(folder / "b.jsonl", ALPACA)
    data, _ = prepare(DatasetConfig(path="folder", max_samples=3))
    assert [f.read for f in data.report.files] == [2, 1]
    assert len(data.train) == 3


def test_missing_file_and_unsupported_type(tmp_path, prepare):
    with pytest.raises(DataError, match="file not found"):
        prepare("nope.jsonl")
    (tmp_path / "d.xlsx").write_text("x")
    with pytest.raises(DataError, match="unsupported file type '.xlsx'"):
        prepare("d.xlsx")


def test_malformed_jsonl_lines_are_reported_with_line_numbers(tmp_path, prepare):
    lines = [
        json.dumps(ALPACA[0]),
        "",
        '{"instruction": "x", "output": "y",}',
        json.dumps(ALPACA[1]),
        "{oops",
    ]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        prepare("bad.jsonl")
    message = str(err.value)
    assert "bad.jsonl row 2 (line 3): malformed JSON" in message
    assert "bad.jsonl row 4 (line 5): malformed JSON" in message
    assert "2 invalid row(s)" in message
    data, _ = prepare("bad.jsonl", on_invalid="skip")
    assert len(data.train) == 2
    stats = data.report.files[0]
    assert (stats.read, stats.kept, stats.rejected) == (4, 2, 2)


def test_malformed_json_array_reports_line_and_column(tmp_path, prepare):
    (tmp_path / "bad.json").write_text(
        '[\n  {"instruction": "q", "output": "a"},\n  {"instruction": "q" "output": "a"}\n]\n'
    )
    with pytest.raises(DataError) as err:
        prepare("bad.json")
    assert "bad.json line 3: malformed JSON: Expecting ',' delimiter at line 3, column 23" in str(
        err.value
    )


# --- LLaMA-Factory dataset_info.json --------------------------------------------------


@pytest.fixture
def registry(tmp_path):
    lf = tmp_path / "lf"
    lf.mkdir()
    write_jsonl(
        lf / "qa.jsonl", [{"q": "Who are you?", "ctx": "", "a": "I am Keel.", "sys": "Be brief."}]
    )
    write_jsonl(
        lf / "chat.jsonl",
        [{"dialog": [{"speaker": "client", "text": "hello"}, {"speaker": "bot", "text": "hi"}]}],
    )
    info = {
        "my_alpaca": {
            "file_name": "qa.jsonl",
            "columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys"},
        },
        "my_sharegpt": {
            "file_name": "chat.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog"},
            "tags": {
                "role_tag": "speaker",
                "content_tag": "text",
                "user_tag": "client",
                "assistant_tag": "bot",
            },
        },
        "my_dpo": {
            "file_name": "qa.jsonl",
            "ranking": True,
            "columns": {"chosen": "a", "rejected": "a"},
        },
        "alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en"},
    }
    (lf / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path


def test_dataset_info_alpaca_and_sharegpt_entries(registry, prepare):
    data, texts = prepare("my_alpaca", "my_sharegpt", dataset_dir="lf")
    assert "Be brief." in texts[0] and "I am Keel." in texts[0]
    assert "hello" in texts[1] and texts[1].count("hi") == 1
    assert [f.file for f in data.report.files] == ["lf/qa.jsonl", "lf/chat.jsonl"]


def test_dataset_info_ranking_entry_needs_a_preference_stage(registry, prepare):
    with pytest.raises(DataError, match="my_dpo.*preference stage.*dpo, orpo, simpo or rm"):
        prepare("my_dpo", dataset_dir="lf")


def test_dataset_info_hub_entry_is_read_from_the_hub_cache(registry, prepare, monkeypatch):
    """An hf_hub_url entry is a Hub dataset (tests/unit/test_hub_datasets.py reads one);
    offline and not in the cache, the error names the entry and the download command."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(registry / "empty-hub"))
    with pytest.raises(DataError) as err:
        prepare("alpaca_en", dataset_dir="lf")
    assert "(alpaca_en)" in str(err.value) and "not in the Hugging Face cache" in str(err.value)
    assert "hf download llamafactory/alpaca_en --repo-type dataset" in str(err.value)


def test_dataset_info_unknown_name_suggests_closest(registry, prepare):
    with pytest.raises(DataError, match="closest: my_alpaca"):
        prepare("my_alpacca", dataset_dir="lf")


def test_dataset_dir_without_registry(tmp_path, prepare):
    (tmp_path / "lf").mkdir()
    with pytest.raises(DataError, match="has no dataset_info.json"):
        prepare("x", dataset_dir="lf")


# --- encodings and splits ----------------------------------------------------------------

BOM = b"\xef\xbb\xbf"


def test_utf8_bom_is_accepted_in_every_text_format(tmp_path, prepare):
    import csv
    import io

    (tmp_path / "a.json").write_bytes(BOM + json.dumps(ALPACA[:1]).encode())
    (tmp_path / "b.jsonl").write_bytes(BOM + (json.dumps(ALPACA[1]) + "\n").encode())
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["instruction", "input", "output"])
    writer.writeheader()
    writer.writerow(ALPACA[2])
    (tmp_path / "c.csv").write_bytes(BOM + out.getvalue().encode())
    _, texts = prepare("a.json", "b.jsonl", "c.csv")
    assert [t.count("\ufeff") for t in texts] == [0, 0, 0]
    assert "I am Keel." in texts[0] and "Bonjour" in texts[1] and "Eat well" in texts[2]
    (tmp_path / "d.txt").write_bytes(BOM + b"The quick brown fox.\n")
    _, texts = prepare("d.txt", stage="pt")  # datasets' text loader alone would keep the BOM
    assert texts == ["The quick brown fox.<|im_end|>"]


def test_non_utf8_file_in_a_folder_is_named_with_its_line(tmp_path, prepare):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ALPACA[:2])
    (folder / "b.jsonl").write_bytes(
        b'{"instruction": "ok", "output": "ok"}\n{"output": "caf\xe9"}\n'
    )
    with pytest.raises(DataError) as err:
        prepare("folder")
    assert str(err.value).startswith("data file folder/b.jsonl is not UTF-8: line 2, column 16 ")


def test_split_of_a_file_is_train_or_a_slice(tmp_path, prepare):
    write_jsonl(tmp_path / "d.jsonl", ALPACA)
    _, texts = prepare(DatasetConfig(path="d.jsonl", split="train[1:]"))
    assert len(texts) == 2 and "Bonjour" in texts[0]
    with pytest.raises(DataError, match="split 'test' cannot be used.*one split"):
        prepare(DatasetConfig(path="d.jsonl", split="test"))


def test_split_slice_of_a_saved_dataset_dict(tmp_path, prepare):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ALPACA)}).save_to_disk(str(tmp_path / "dd"))
    _, texts = prepare(DatasetConfig(path="dd", split="train[:1]+train[-1:]"))
    assert len(texts) == 2 and "I am Keel." in texts[0] and "Eat well" in texts[1]


# --- compressed files: corpora as they are published -----------------------------------

CODECS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}


def compress(data: bytes, codec: str) -> bytes:
    import importlib

    if codec == ".zst":
        import zstandard

        # two frames, as large corpora are written in blocks: both must be read
        half = len(data) // 2
        return b"".join(zstandard.ZstdCompressor().compress(p) for p in (data[:half], data[half:]))
    return importlib.import_module(CODECS[codec]).compress(data)


@pytest.mark.parametrize("codec", CODECS)
def test_a_compressed_file_gives_the_rows_of_the_plain_one(tmp_path, prepare, codec):
    plain = write_jsonl(tmp_path / "d.jsonl", ALPACA)
    (tmp_path / f"d.jsonl{codec}").write_bytes(compress(plain.read_bytes(), codec))
    want, want_texts = prepare("d.jsonl")
    got, texts = prepare(f"d.jsonl{codec}")
    assert texts == want_texts and len(texts) == 3
    assert [f.file for f in got.report.files] == [f"d.jsonl{codec}"]
    (tmp_path / f"d.txt{codec}").write_bytes(compress(b"The quick brown fox.\n\nA dog.\n", codec))
    _, texts = prepare(f"d.txt{codec}", stage="pt")  # the text loader, blank lines skipped
    assert texts == ["The quick brown fox.<|im_end|>", "A dog.<|im_end|>"]


def test_a_folder_reads_its_compressed_files_and_checks_them_decompressed(tmp_path, prepare):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ALPACA[:1])
    rows = b'{"instruction": "ok", "output": "ok"}\n{"output": "caf\xe9"}\n'
    (folder / "b.jsonl.gz").write_bytes(compress(rows, ".gz"))
    (folder / "c.parquet.gz").write_bytes(b"not read")  # parquet is compressed inside
    with pytest.raises(DataError) as err:
        prepare("corpus")
    # the UTF-8 check reads the decompressed text: the line and column are its own
    assert str(err.value).startswith("data file corpus/b.jsonl.gz is not UTF-8: line 2, column 16")
    (folder / "b.jsonl.gz").write_bytes(compress(json.dumps(ALPACA[1]).encode() + b"\n", ".gz"))
    data, _ = prepare("corpus")
    assert [f.file for f in data.report.files] == ["corpus/a.jsonl", "corpus/b.jsonl.gz"]


def test_a_truncated_archive_and_a_long_compressed_row_are_named(tmp_path, prepare):
    whole = compress(write_jsonl(tmp_path / "d.jsonl", ALPACA).read_bytes(), ".gz")
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"cannot read data file cut.jsonl.gz: it ends early"):
        prepare("cut.jsonl.gz")
    big = {**ALPACA[0], "output": "x" * 5000}  # 5 KB decompressed, far less compressed
    (tmp_path / "big.jsonl.xz").write_bytes(compress((json.dumps(big) + "\n").encode(), ".xz"))
    with pytest.raises(DataError, match=r"big.jsonl.xz: line 1 is larger than data.max_row_bytes"):
        prepare("big.jsonl.xz", max_row_bytes=4096)
    with pytest.raises(DataError, match=r"unsupported file type '.parquet.gz'"):
        (tmp_path / "t.parquet.gz").write_bytes(b"x")
        prepare("t.parquet.gz")
