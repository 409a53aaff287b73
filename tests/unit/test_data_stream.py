"""data.streaming: the streamed rows are the prepared rows, resumable from any position."""

from __future__ import annotations

import json

import pytest

import keel.data.stream as stream_module
from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.data.stream import Cursor, prepare_stream
from keel.errors import DataError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.name


def documents(start: int, count: int) -> list[dict]:
    """Pretraining rows of varied lengths, some over 64 tokens (cut into pieces)."""
    return [{"text": f"document {i}: " + "word " * (3 + 11 * (i % 9))} for i in range(start, count)]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(stream_module, "BLOCK_ROWS", 5)  # many blocks from a few rows


@pytest.fixture
def streamed(tiny_tokenizer, tmp_path):
    """streamed(files, stage=..., **data): (prepared rows, a function opening the stream)."""
    logs: list[str] = []

    def make(paths, *, stage="pt", prepared=True, **data):
        cfg = DataConfig(datasets=[DatasetConfig(path=p) for p in paths], cutoff_len=64, **data)
        common = {"stage": stage, "base_dir": tmp_path, "seed": 3, "log": logs.append}
        rows = None
        if prepared:
            ready = prepare_data(cfg, tiny_tokenizer, cache_dir=tmp_path / "cache", **common)
            rows = [dict(r) for r in ready.train]
        data = prepare_stream(cfg, tiny_tokenizer, cache_dir=tmp_path / "cache", **common)
        return rows, lambda: data.open(logs.append)

    make.logs = logs
    return make


def test_streamed_rows_are_the_prepared_rows_epoch_after_epoch(streamed, tmp_path, small_blocks):
    first = write_jsonl(tmp_path / "a.jsonl", documents(0, 13))
    second = write_jsonl(tmp_path / "b.jsonl", documents(13, 20))
    prepared, open_stream = streamed([first, second], shuffle=False)
    assert any(r["position_ids"][0] == 0 and len(r["input_ids"]) == 64 for r in prepared)  # cut
    rows = open_stream().take(2 * len(prepared) + 3)
    assert rows[: len(prepared)] == prepared  # in order, with every long document's pieces
    assert rows[len(prepared) : 2 * len(prepared)] == prepared  # the next epoch: again
    conversations = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(7)
    ]
    chat = write_jsonl(tmp_path / "c.jsonl", conversations)
    prepared, open_stream = streamed([chat], stage="sft", shuffle=False)
    assert open_stream().take(len(prepared)) == prepared


def test_a_compressed_corpus_streams_as_its_prepared_rows(streamed, tmp_path, small_blocks):
    import zstandard

    plain = write_jsonl(tmp_path / "a.jsonl", documents(0, 13))  # its name
    packed = zstandard.ZstdCompressor().compress((tmp_path / plain).read_bytes())
    (tmp_path / "a.jsonl.zst").write_bytes(packed)
    want, _ = streamed([plain], shuffle=False)
    prepared, open_stream = streamed(["a.jsonl.zst"], shuffle=False)
    assert prepared == want
    assert open_stream().take(len(prepared)) == prepared


def test_streamed_rows_drop_what_is_under_min_len_as_prepared_rows_do(
    streamed, tmp_path, small_blocks
):
    """data.min_len: short documents and the short last pieces of long ones are left out,
    the same ones streamed as prepared, and each block says how many it dropped."""
    path = write_jsonl(tmp_path / "a.jsonl", documents(0, 13))
    every, _ = streamed([path], shuffle=False)
    prepared, open_stream = streamed([path], shuffle=False, min_len=40)
    assert all(len(r["input_ids"]) >= 40 for r in prepared)
    assert 0 < len(prepared) < len(every)  # the negative control: 0 keeps them
    assert open_stream().take(len(prepared)) == prepared
    assert any("under data.min_len dropped" in line for line in streamed.logs)


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_resumed_at_its_cursor_gives_the_same_rows(
    streamed, tmp_path, small_blocks, packing
):
    files = [
        write_jsonl(tmp_path / f"{name}.jsonl", documents(k * 9, k * 9 + 9))
        for k, name in enumerate("abc")
    ]
    _, open_stream = streamed(files, prepared=False, packing=packing)  # shuffled
    whole = open_stream().take(60)  # several epochs of shuffled files and blocks
    for cut in (1, 7, 23, 41):
        reader = open_stream()
        head = reader.take(cut)
        resumed = open_stream()
        resumed.seek(Cursor(**vars(reader.cursor)))
        assert head + resumed.take(60 - cut) == whole
    epochs = open_stream()
    order = []
    while epochs.cursor.epoch < 3:
        order.append((epochs.cursor.epoch, epochs._order(epochs.cursor.epoch)))
        epochs.take(5)
    assert len({tuple(o) for _, o in order}) > 1  # the file order changes with the epoch


def test_blank_lines_of_a_text_file_are_not_documents(streamed, tmp_path):
    (tmp_path / "t.txt").write_text("first document\n\n  \nsecond document\n")
    prepared, open_stream = streamed(["t.txt"], shuffle=False)
    assert len(prepared) == 2 and open_stream().take(2) == prepared


def test_a_bad_row_stops_the_run_naming_its_file_and_row(streamed, tmp_path, small_blocks):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    rows = rows * 7 + [{"messages": [{"role": "user", "content": "q"}]}]  # no answer: row 8
    name = write_jsonl(tmp_path / "d.jsonl", rows)
    _, open_stream = streamed([name], stage="sft", prepared=False, shuffle=False)
    with pytest.raises(DataError, match=r"d.jsonl row 8: .*set data.on_invalid: skip"):
        open_stream().take(20)
    _, open_stream = streamed([name], stage="sft", prepared=False, shuffle=False, on_invalid="skip")
    assert len(open_stream().take(20)) == 20  # row 8 skipped, said once
    assert any("d.jsonl rows 6-8: 1 rejected and skipped" in line for line in streamed.logs)


def test_a_stream_with_no_usable_row_is_refused(streamed, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}]
    name = write_jsonl(tmp_path / "d.jsonl", rows * 3)
    _, open_stream = streamed([name], stage="sft", prepared=False, on_invalid="skip")
    with pytest.raises(DataError, match="no usable samples in the streamed training data"):
        open_stream().take(1)


def test_streaming_refuses_what_needs_the_whole_data_first(tmp_path):
    from keel.config import load_config
    from keel.errors import ConfigError

    base = {
        "model": {"path": "bundled:smollm2-135m-instruct"},
        "data": {"datasets": ["d.jsonl"], "streaming": True, "val_size": 0.1},
        "train": {"stage": "dpo", "early_stopping_patience": 2, "eval_every": 1},
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError) as info:
        load_config(None, [], base=base)
    problems = "\n".join(info.value.problems)
    assert "train.stage dpo's data is prepared whole" in problems
    assert "set train.max_steps" in problems
    assert "data.val_size = 0.1 needs the whole training data" in problems
    assert "no eval data: set data.eval_datasets (data.streaming holds no rows out)" in problems


def test_a_streaming_run_trains_and_evaluates_as_the_prepared_run(
    tiny_model_dir, data_file, tmp_path
):
    """The same rows in the same order (shuffle off) make the same steps; the evaluation
    data of its own (data.eval_datasets) is prepared whole beside the stream."""
    from test_train_run import config, quiet

    from keel.train.run import run_training

    rows = [
        {"instruction": f"Count to {n}.", "output": " ".join(map(str, range(n)))} for n in (3, 5)
    ]
    held_out = write_jsonl(tmp_path / "held_out.jsonl", rows)
    common = (
        *("data.val_size=0", "data.shuffle=false", "method.lora.dropout=0", "train.max_steps=5"),
        *(f"data.eval_datasets=[{tmp_path / held_out}]", "train.eval_every=2"),
    )

    def eval_losses(out):
        records = map(json.loads, (out / "metrics.jsonl").open())
        return [r["eval_loss"] for r in records if "eval_loss" in r]

    prepared = run_training(config(tiny_model_dir, data_file, tmp_path / "a", *common), log=quiet)
    logs: list[str] = []
    streaming = config(tiny_model_dir, data_file, tmp_path / "b", *common, "data.streaming=true")
    streamed = run_training(streaming, log=logs.append)
    assert streamed.losses == pytest.approx(prepared.losses, rel=1e-6, abs=1e-7)
    assert len(set(streamed.losses)) == 5  # 5 steps of 4 of the 16 rows: epochs 1 and 2
    assert any("training: streamed rows, global batch 4 rows" in line for line in logs)
    evaluated = eval_losses(tmp_path / "b")
    assert len(evaluated) == 3  # steps 2, 4 and the last
    assert evaluated == pytest.approx(eval_losses(tmp_path / "a"), rel=1e-6, abs=1e-7)
