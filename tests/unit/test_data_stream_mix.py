"""data.mix interleave_* with data.streaming: each streamed block draws rows from every
dataset (by weight, or in turn), each dataset reads on where it stopped, a dataset that
runs out ends the epoch, is read again or drops out (under, over, once), and a resumed
stream gives the rows the unbroken one gives."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import stream as stream_module
from keel.data.stream import prepare_stream

BLOCK = 8  # rows a block draws (BLOCK_ROWS, made small)


@pytest.fixture
def open_mix(tiny_tokenizer, tmp_path, monkeypatch):
    """open_mix(a=40, b=10, **data) -> a new stream over a.jsonl and b.jsonl (documents
    named "a 3", "b 7", ...), mixed as `data` says."""
    monkeypatch.setattr(stream_module, "BLOCK_ROWS", BLOCK)

    def make(a: int = 40, b: int = 10, **data):
        for name, n in (("a", a), ("b", b)):
            rows = [{"text": f"doc {name} {i} " + "word " * (i % 5)} for i in range(n)]
            (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = DataConfig(
            datasets=[DatasetConfig(path="a.jsonl"), DatasetConfig(path="b.jsonl")],
            cutoff_len=64, streaming=True, **data,
        )  # fmt: skip
        ready = prepare_stream(
            cfg, tiny_tokenizer, stage="pt", cache_dir=tmp_path / "cache", base_dir=tmp_path,
            seed=3, log=lambda _m: None,
        )  # fmt: skip
        return lambda: ready.open(lambda _m: None)

    return make


def names(rows: list[dict], tokenizer) -> list[str]:
    return [re.search(r"doc ([ab] \d+)", tokenizer.decode(r["input_ids"])).group(1) for r in rows]


def test_each_block_draws_from_both_in_turn_and_an_epoch_ends_when_one_runs_out(
    open_mix, tiny_tokenizer
):
    stream = open_mix(mix="interleave_under")()
    first = names(stream.take(BLOCK), tiny_tokenizer)
    assert Counter(n[0] for n in first) == {"a": 4, "b": 4}  # a block: half of each
    rest = names(stream.take(14), tiny_tokenizer)  # b's 10 rows end the epoch at 22
    epoch = first + rest
    assert Counter(n[0] for n in epoch) == {"a": 12, "b": 10} and len(set(epoch)) == 22
    assert stream.cursor.epoch == 1 and stream.progress() == 1.0  # both start again
    again = names(stream.take(BLOCK), tiny_tokenizer)
    assert Counter(n[0] for n in again) == {"a": 4, "b": 4}


def test_weights_set_each_datasets_share(open_mix, tiny_tokenizer):
    stream = open_mix(a=400, b=400, mix="interleave_over", mix_weights=[0.75, 0.25])()
    drawn = Counter(n[0] for n in names(stream.take(320), tiny_tokenizer))
    assert abs(drawn["a"] / 320 - 0.75) < 0.06  # multinomial draws, 40 blocks
    plain = open_mix(a=400, b=400)()  # the negative control: concat reads a.jsonl first
    assert set(n[0] for n in names(plain.take(320), tiny_tokenizer)) == {"a"}


def test_over_reads_a_short_dataset_again_and_once_reads_every_row_once(open_mix, tiny_tokenizer):
    over = names(open_mix(mix="interleave_over")().take(80), tiny_tokenizer)
    assert Counter(n[0] for n in over[:80]) == {"a": 40, "b": 40}  # b read 4 times
    assert len({n for n in over if n[0] == "a"}) == 40  # a once, to its end
    once = open_mix(mix="interleave_once")()
    epoch = names(once.take(50), tiny_tokenizer)
    assert sorted(epoch) == sorted([f"a {i}" for i in range(40)] + [f"b {i}" for i in range(10)])
    assert once.cursor.epoch == 1


@pytest.mark.parametrize("mix", ["interleave_under", "interleave_over", "interleave_once"])
def test_a_resumed_mixed_stream_gives_the_unbroken_rows(open_mix, mix):
    weights = [0.6, 0.4] if mix != "interleave_under" else []
    opened = open_mix(mix=mix, mix_weights=weights, packing=True)
    unbroken = opened().take(70)
    first = opened()
    head = first.take(23)  # inside a block, several blocks and datasets' files in
    state = json.loads(json.dumps(first.state()))  # as a checkpoint holds it
    resumed = opened()
    resumed.seek_state(state)
    assert head + resumed.take(47) == unbroken
