"""prepare_data end to end: validation and the report, over-length policies, split, packing, cache."""

from __future__ import annotations

import json
import os

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import DataReport, PreparedData, prepare_data
from keel.errors import DataError


def conversation(i: int, answer: str | None = None) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {
                "role": "assistant",
                "content": answer if answer is not None else f"answer {i} " * (1 + i % 3),
            },
        ]
    }


GOOD = [conversation(i) for i in range(10)]


@pytest.fixture
def run(tiny_tokenizer, tmp_path):
    """run(rows, **data) writes rows to d.jsonl and prepares them; logs land in run.logs."""
    logs: list[str] = []

    def prepare(rows=None, *, stage="sft", seed=0, path="d.jsonl", **data) -> PreparedData:
        if rows is not None:
            (tmp_path / path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return prepare_data(
            DataConfig(datasets=[DatasetConfig(path=path)], **data),
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=seed,
            log=logs.append,
        )

    prepare.logs = logs
    return prepare


def all_rows(ds) -> list[dict]:
    return [dict(r) for r in ds]


# --- validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}, {"content": "a"}]},
            "message 2 of 'messages': missing field 'role'",
        ),
        ({"conversation": []}, "missing field 'messages'"),
        (
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
            "wrong role order",
        ),
        (conversation(0, answer=""), "empty answer"),
    ],
)
def test_invalid_row_error_names_file_and_row(run, bad, reason):
    rows = GOOD[:3] + [bad] + GOOD[3:5]
    with pytest.raises(DataError) as err:
        run(rows)
    message = str(err.value)
    assert f"d.jsonl row 4: {reason}" in message
    assert "data.on_invalid: skip" in message  # the fix is in the message
    assert "Traceback" not in message


def test_on_invalid_skip_keeps_good_rows_and_reports(run):
    rows = GOOD[:3] + [conversation(0, answer=""), {"messages": "oops"}] + GOOD[3:5]
    data = run(rows, on_invalid="skip")
    assert len(data.train) == 5
    stats = data.report.files[0]
    assert (stats.read, stats.kept, stats.rejected) == (7, 5, 2)
    assert [(r.row, r.file) for r in data.report.rejections] == [(4, "d.jsonl"), (5, "d.jsonl")]
    text = data.report.format()
    assert "skipped, data.on_invalid=skip" in text and "d.jsonl row 5" in text
    assert text in run.logs  # logged once
    assert sum(line == text for line in run.logs) == 1


def test_error_listing_is_capped(run):
    rows = [conversation(i, answer="") for i in range(60)] + GOOD[:1]
    with pytest.raises(DataError) as err:
        run(rows)
    message = str(err.value)
    assert "60 invalid row(s)" in message and "row 50:" in message and "row 51:" not in message
    assert "and 10 more" in message


def test_zero_usable_samples(run):
    with pytest.raises(DataError, match="no usable samples"):
        run([conversation(0, answer="")], on_invalid="skip")


def test_sharegpt_messages_in_a_messages_column_are_read(run, tiny_tokenizer):
    # detected as sharegpt by its from/value tags, read from the column it was found in
    row = {"messages": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    data = run([row])
    trained = [t for t in data.train[0]["targets"] if t != -100]
    assert tiny_tokenizer.decode(trained) == "a<|im_end|>"


def test_sft_on_plain_text_asks_for_pretraining(run):
    with pytest.raises(DataError, match="train.stage: pt"):
        run([{"text": "hello"}])


# --- over-length policies -------------------------------------------------------------


LONG = conversation(99, answer="long answer " * 40)


def test_overlength_drop_counts(run):
    data = run([*GOOD[:4], LONG], cutoff_len=64)
    assert len(data.train) == 4
    assert data.report.files[0].dropped == 1
    assert max(len(r["input_ids"]) for r in data.train) <= 64


def test_overlength_error_lists_rows_with_lengths(run, tiny_tokenizer):
    with pytest.raises(DataError) as err:
        run([*GOOD[:2], LONG, LONG], cutoff_len=64, overlength="error")
    message = str(err.value)
    assert "2 row(s) longer than data.cutoff_len=64" in message
    assert "d.jsonl row 3:" in message and "d.jsonl row 4:" in message and " tokens" in message
    assert "overlength: truncate" in message


def test_overlength_truncate_cuts_to_cutoff(run):
    data = run([*GOOD[:2], LONG], cutoff_len=64, overlength="truncate")
    assert data.report.files[0].truncated == 1
    long_row = data.train[2]
    assert len(long_row["input_ids"]) == 64 and long_row["targets"][-1] == -100
    assert long_row["num_targets"] == sum(t != -100 for t in long_row["targets"]) > 0


def test_all_labels_masked_after_truncation(run):
    long_question = {
        "messages": [
            {"role": "user", "content": "question " * 60},
            {"role": "assistant", "content": "answer"},
        ]
    }
    with pytest.raises(DataError, match="d.jsonl row 2: all labels masked after truncation"):
        run([GOOD[0], long_question], cutoff_len=48, overlength="truncate")


def test_train_on_prompt_trains_the_prompt_tokens_as_well(run, tiny_tokenizer):
    system = {"role": "system", "content": "be brief"}
    rows = [{"messages": [system, *conversation(i)["messages"]]} for i in range(3)]
    answers_only = run(rows)
    everything = run(rows, train_on_prompt=True)
    assert everything.fingerprint != answers_only.fingerprint  # not the other's cache
    assert "train_on_prompt on" in everything.report.format()
    assert "train_on_prompt" not in answers_only.report.format()
    for masked, full in zip(answers_only.train, everything.train, strict=True):
        ids = full["input_ids"]
        assert masked["input_ids"] == ids  # the same tokens; only what trains differs
        assert full["targets"] == ids[1:] + [-100]  # every next token, the prompt's too
        trained = [t for t in masked["targets"] if t != -100]
        # negative control: without it the prompt (system and user turns) does not train
        assert "be brief" not in tiny_tokenizer.decode(trained)
        assert "be brief" in tiny_tokenizer.decode([t for t in full["targets"] if t != -100])
        assert 0 < full["num_targets"] - masked["num_targets"] < len(ids)
    assert everything.report.train.targets == sum(r["num_targets"] for r in everything.train)


def test_mask_history_trains_the_last_answer_only(run, tiny_tokenizer):
    turns = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "early answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "final answer"},
    ]
    every_turn = run([{"messages": turns}])
    last_turn = run([{"messages": turns}], mask_history=True)
    assert last_turn.fingerprint != every_turn.fingerprint
    assert "mask_history on" in last_turn.report.format()
    (all_row,), (last_row,) = every_turn.train, last_turn.train
    assert all_row["input_ids"] == last_row["input_ids"]

    def trained(row):
        return tiny_tokenizer.decode([t for t in row["targets"] if t != -100])

    assert "early answer" in trained(all_row) and "final answer" in trained(all_row)
    assert "early answer" not in trained(last_row) and "final answer" in trained(last_row)
    # the last answer's tokens are trained exactly as without it
    assert [t for t in last_row["targets"] if t != -100] == [
        t for t in all_row["targets"] if t != -100
    ][-last_row["num_targets"] :]


def test_deduplicate_drops_exact_copies_before_the_split(run):
    rows = [conversation(i % 4) for i in range(12)]  # 4 distinct samples, each 3 times
    rows.append({**conversation(1), "source": "elsewhere"})  # a column keel does not read
    every = run(rows, val_size=2)
    assert every.report.duplicates == 0 and len(every.train) + len(every.eval) == 13
    unique = run(rows, val_size=2, deduplicate=True)
    assert unique.fingerprint != every.fingerprint
    assert unique.report.duplicates == 9
    assert "9 duplicate samples dropped (data.deduplicate" in unique.report.format()
    kept = [tuple(r["input_ids"]) for r in [*unique.train, *unique.eval]]
    assert len(kept) == len(set(kept)) == 4  # and no eval sample is a copy of a training one
    assert run(rows, val_size=2, deduplicate=True).from_cache  # the count survives the cache
    assert run(rows, val_size=2, deduplicate=True).report.duplicates == 9


# --- pretraining ----------------------------------------------------------------------


def test_pt_trains_every_token_of_text_and_conversations(run, tiny_tokenizer, tmp_path):
    data = run([{"text": "The quick brown fox."}], stage="pt")
    row = data.train[0]
    assert tiny_tokenizer.decode(row["input_ids"]) == "The quick brown fox.<|im_end|>"
    assert row["targets"] == row["input_ids"][1:] + [-100]
    data = run(GOOD[:1], stage="pt", path="c.jsonl")
    row = data.train[0]
    assert "question 0" in tiny_tokenizer.decode(row["input_ids"])
    assert row["num_targets"] == len(row["input_ids"]) - 1


def test_pt_texts_tokenized_in_one_call_give_each_rows_tokens(run, tiny_tokenizer, monkeypatch):
    from keel.data.encode import RowEncoder

    rows = [{"text": f"document {i} " + "word " * i} for i in range(1, 70)]
    rows.append({"text": "   "})  # rejected, with its reason, beside the batch
    calls = []
    batched = RowEncoder._tokenized_texts

    def counted(self, batch_rows):
        calls.append(len(batch_rows))
        return batched(self, batch_rows)

    monkeypatch.setattr(RowEncoder, "_tokenized_texts", counted)
    data = run(rows, stage="pt", shuffle=False, on_invalid="skip", cutoff_len=512)
    assert calls and max(calls) > 1  # whole batches of rows at a time
    assert [r["input_ids"] for r in data.train] == [
        tiny_tokenizer(r["text"])["input_ids"] + [tiny_tokenizer.eos_token_id] for r in rows[:-1]
    ]
    assert data.report.files[0].rejected == 1


def long_document(i: int, words: int = 40) -> dict:
    """A pretraining document over 64 tokens whose every piece names it: <i> repeated."""
    return {"text": f"<{i}> " * words}


def test_pt_cuts_long_documents_into_pieces_by_default(run, tiny_tokenizer):
    document, short = long_document(7), {"text": "The quick brown fox."}
    data = run([document, short], stage="pt", cutoff_len=64, shuffle=False)
    assert data.report.overlength == "split"  # auto, for pt
    assert (data.report.files[0].kept, data.report.files[0].cut) == (2, 1)
    whole = tiny_tokenizer(document["text"])["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert len(whole) > 2 * 64
    short_ids = tiny_tokenizer(short["text"])["input_ids"] + [tiny_tokenizer.eos_token_id]
    pieces = [r for r in all_rows(data.train) if r["input_ids"] != short_ids]
    assert [x for r in pieces for x in r["input_ids"]] == whole  # in order, nothing lost
    assert [len(r["input_ids"]) for r in pieces[:-1]] == [64] * (len(pieces) - 1)
    for piece in pieces:  # each a sample of its own: no target crosses into the next piece
        assert piece["targets"] == piece["input_ids"][1:] + [-100]
        assert piece["num_targets"] == len(piece["input_ids"]) - 1
    assert (data.report.train.samples, data.report.train.pieces) == (2, len(pieces) + 1)
    report = data.report.format()
    assert "split" in report.splitlines()[1] and "(cut into" in report
    # the negative control: drop loses the document
    dropped = run([document, short], stage="pt", cutoff_len=64, overlength="drop")
    assert len(dropped.train) == 1 and dropped.report.files[0].dropped == 1
    assert dropped.fingerprint != data.fingerprint


def test_a_documents_pieces_stay_in_its_split(run, tiny_tokenizer):
    import re

    data = run([long_document(i) for i in range(12)], stage="pt", cutoff_len=32, val_size=4)
    assert data.report.eval.samples == 4 and data.report.eval.pieces > 4

    def documents(rows) -> set[str]:
        found = [set(re.findall(r"<(\d+)>", tiny_tokenizer.decode(r["input_ids"]))) for r in rows]
        assert all(len(names) == 1 for names in found)  # a piece holds one document
        return set().union(*found)

    train, held_out = documents(all_rows(data.train)), documents(all_rows(data.eval))
    assert len(held_out) == 4 and not train & held_out and len(train) == 8


def test_overlength_split_with_packing_keeps_pieces_apart(run):
    data = run([long_document(1), long_document(2)], stage="pt", cutoff_len=64, packing=True)
    for row in all_rows(data.train):
        assert len(row["input_ids"]) <= 64
        assert row["position_ids"][0] == 0 and row["targets"][-1] == -100


def test_overlength_error_offers_split_for_pretraining(run):
    with pytest.raises(DataError, match=r"or split \(cut them into pieces\)"):
        run([long_document(1)], stage="pt", cutoff_len=64, overlength="error")


def test_overlength_auto_is_drop_outside_pretraining(run):
    data = run([*GOOD[:4], LONG], cutoff_len=64)
    assert data.report.overlength == "drop" and data.report.files[0].dropped == 1


def test_min_len_drops_short_samples_and_counts_them(run):
    every = run(GOOD[:6], cutoff_len=256)  # the negative control: 0 keeps every length
    lengths = sorted(len(r["input_ids"]) for r in all_rows(every.train))
    floor = lengths[2]
    assert lengths[1] < floor  # two samples are shorter
    data = run(GOOD[:6], min_len=floor, cutoff_len=256)
    assert data.report.files[0].short == 2 and data.report.files[0].kept == 4
    assert data.report.files[0].rejected == 0 and data.report.files[0].dropped == 0
    assert sorted(len(r["input_ids"]) for r in all_rows(data.train)) == lengths[2:]
    report = data.report.format()
    assert f"min_len {floor}" in report.splitlines()[0]
    assert report.splitlines()[1].split()[-2:] == ["short", "rejected"]
    assert len(every.train) == 6 and "short" not in every.report.format()
    assert every.fingerprint != data.fingerprint


def test_min_len_drops_a_documents_short_last_piece(run, tiny_tokenizer):
    """Axolotl's min_sample_len also drops the short chunks its completion texts are cut
    into: a document of 2 full pieces and a short one keeps 2."""
    document = long_document(3)
    whole = tiny_tokenizer(document["text"])["input_ids"] + [tiny_tokenizer.eos_token_id]
    tail = len(whole) % 64
    assert len(whole) > 2 * 64 and 1 < tail < 60
    kept = run([document], stage="pt", cutoff_len=64, min_len=60, shuffle=False)
    pieces = [r["input_ids"] for r in all_rows(kept.train)]
    assert pieces == [whole[i : i + 64] for i in range(0, len(whole) - tail, 64)]
    assert kept.report.files[0].short == 0  # the document is long enough; its tail is not
    every = run([document], stage="pt", cutoff_len=64, shuffle=False)
    assert len(every.train) == len(pieces) + 1


# --- split and packing ----------------------------------------------------------------


def test_val_split_fraction_count_and_determinism(run):
    rows = [conversation(i) for i in range(20)]
    data = run(rows, val_size=0.25)
    assert (len(data.train), len(data.eval)) == (15, 5)
    assert (data.report.train.samples, data.report.eval.samples) == (15, 5)
    data3 = run(rows, val_size=3)
    assert (len(data3.train), len(data3.eval)) == (17, 3)
    assert run(rows, val_size=0).eval is None
    again = run(rows, val_size=0.25, cutoff_len=1000)  # same seed, new cache entry: same split
    assert all_rows(again.eval) == all_rows(data.eval)
    other = run(rows, val_size=0.25, seed=1)
    assert all_rows(other.eval) != all_rows(data.eval)
    with pytest.raises(DataError, match="leaving none to train on"):
        run(rows, val_size=20)


def _segments(row):
    """Split a packed row into its samples by position_ids restarting at 0."""
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
    return [(a, b) for a, b in zip(starts, starts[1:])]


def test_packing_keeps_every_sample_once_within_cutoff(run):
    rows = [conversation(i) for i in range(30)]
    plain = run(rows)
    packed = run(rows, packing=True, cutoff_len=128)
    assert len(packed.train) < len(plain.train)
    samples = []
    for row in packed.train:
        assert len(row["input_ids"]) <= 128
        for a, b in _segments(row):
            assert row["position_ids"][a:b] == list(range(b - a))
            assert row["targets"][b - 1] == -100  # never predicts the next sample's first token
            samples.append((tuple(row["input_ids"][a:b]), tuple(row["targets"][a:b])))
        assert row["num_targets"] == sum(t != -100 for t in row["targets"])
    expected = [(tuple(r["input_ids"]), tuple(r["targets"])) for r in plain.train]
    assert sorted(samples) == sorted(expected)
    assert packed.report.train.targets == plain.report.train.targets
    assert packed.report.train.rows == len(packed.train)
    again = run(rows, packing=True, cutoff_len=128, val_size=0)  # cache hit, same rows
    assert all_rows(again.train) == all_rows(packed.train)


def test_unpacked_rows_have_arange_positions(run):
    data = run(GOOD[:3])
    for row in data.train:
        assert row["position_ids"] == list(range(len(row["input_ids"])))


# --- cache ----------------------------------------------------------------------------


def test_cache_hit_gives_identical_rows_and_report(run, tmp_path):
    first = run(GOOD, val_size=2)
    assert not first.from_cache
    # said before the work (its bar is hidden without --verbose), and only when it is done
    working = [line for line in run.logs if line.startswith("data: reading, checking and")]
    assert len(working) == 1 and "(once: the result is cached)" in working[0]
    second = run(GOOD, val_size=2)
    assert second.from_cache and second.fingerprint == first.fingerprint
    assert any(line.startswith("data: loaded from cache") for line in run.logs)
    assert len([line for line in run.logs if line.startswith("data: reading, checking")]) == 1
    assert all_rows(second.train) == all_rows(first.train)
    assert all_rows(second.eval) == all_rows(first.eval)
    assert isinstance(second.report, DataReport) and second.report == first.report
    assert [p.name for p in (tmp_path / "cache" / "data").iterdir()] == [first.fingerprint]


def test_cache_misses_when_inputs_change(run, tmp_path):
    first = run(GOOD)
    assert run(GOOD, cutoff_len=512).fingerprint != first.fingerprint
    assert run(GOOD, packing=True).fingerprint != first.fingerprint
    assert run(GOOD, stage="pt").fingerprint != first.fingerprint
    # settings added later leave older caches' fingerprints as they were when unset
    assert run(GOOD, train_on_prompt=False).fingerprint == first.fingerprint
    # which rows are refused as too large decides what is kept
    assert run(GOOD, max_row_bytes=4096).fingerprint != first.fingerprint
    assert run(GOOD, max_row_bytes=16 * 2**20).fingerprint == first.fingerprint
    changed = run(GOOD[:9])  # rewrites the file
    assert not changed.from_cache and len(changed.train) == 9


def test_damaged_cache_is_rebuilt(run):
    first = run(GOOD)
    cache = next(line for line in run.logs if line.startswith("data: prepared and cached at"))
    path = cache.rsplit(" ", 1)[-1]
    for name in os.listdir(os.path.join(path, "train")):
        if name.endswith(".arrow"):
            os.remove(os.path.join(path, "train", name))
    again = run(GOOD)
    assert not again.from_cache and all_rows(again.train) == all_rows(first.train)


def test_num_proc_gives_the_same_rows(run):
    rows = [conversation(i) for i in range(12)]
    one = run(rows)
    two = run(rows, num_proc=2, cutoff_len=1023)
    assert all_rows(one.train) == all_rows(two.train)
