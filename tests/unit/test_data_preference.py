"""prepare_data for dpo/orpo/simpo pairs and KTO samples: formats, the row contract, rejections,
over-length policies, packing and the split."""

from __future__ import annotations

import json

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import DataError

IGNORE = -100


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def trl_pair(i: int, chosen: str | None = None, rejected: str | None = None) -> dict:
    return {
        "prompt": f"question {i}",
        "chosen": chosen if chosen is not None else f"answer {i} " * (1 + i % 3),
        "rejected": rejected if rejected is not None else "no",
    }


def kto_row(i: int, label=None) -> dict:
    return {
        "prompt": f"question {i}",
        "completion": f"answer {i} " * (1 + i % 2),
        "label": (i % 2 == 0) if label is None else label,
    }


PAIRS = [trl_pair(i) for i in range(8)]
SAMPLES = [kto_row(i) for i in range(6)]


@pytest.fixture
def run(tiny_tokenizer, tmp_path):
    """run(rows, stage=, **data) writes rows to d.jsonl (or path=) and prepares them."""
    logs: list[str] = []

    def prepare(
        rows=None, *, stage="dpo", seed=0, path="d.jsonl", fmt="auto", columns=None, **data
    ):
        if rows is not None:
            (tmp_path / path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        dataset = DatasetConfig(path=path, format=fmt, columns=columns or {})
        return prepare_data(
            DataConfig(datasets=[dataset], **data),
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=seed,
            log=logs.append,
        )

    prepare.logs = logs
    return prepare


@pytest.fixture
def encode(tiny_tokenizer):
    """encode(*messages) -> the token ids of the conversation rendered by the template."""

    def tokens(*messages):
        text = tiny_tokenizer.apply_chat_template(list(messages), tokenize=False)
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

    return tokens


def sequences(row: dict, prefix: str = "") -> list[tuple[list[int], list[int]]]:
    """The (input_ids, targets) of each sequence of a row, split where positions restart."""
    positions = row[f"{prefix}position_ids"]
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    out = []
    for a, b in zip(starts, starts[1:]):
        assert positions[a:b] == list(range(b - a))  # positions count up inside a sequence
        out.append((row[f"{prefix}input_ids"][a:b], row[f"{prefix}targets"][a:b]))
    return out


def trained(tokenizer, targets: list[int]) -> str:
    return tokenizer.decode([t for t in targets if t != IGNORE])


def check_targets(ids: list[int], targets: list[int]) -> None:
    """Pre-shifted: a target is the next token; the sequence's last position is never one."""
    assert targets[-1] == IGNORE
    for i, t in enumerate(targets[:-1]):
        assert t in (IGNORE, ids[i + 1])


# --- pairs: the row contract and the formats ----------------------------------------------


def test_pair_row_is_chosen_then_rejected_with_only_the_answers_trained(
    run, tiny_tokenizer, encode
):
    data = run([trl_pair(0, chosen="I am Keel.", rejected="No.")])
    (row,) = list(data.train)
    assert row["labels"] == [1, 0] and row["num_targets"] == 1
    (chosen_ids, chosen_t), (rejected_ids, rejected_t) = sequences(row)
    assert chosen_ids == encode(user("question 0"), bot("I am Keel."))  # default system prompt
    assert rejected_ids == encode(user("question 0"), bot("No."))
    assert trained(tiny_tokenizer, chosen_t) == "I am Keel.<|im_end|>"  # through EOS, no "\n"
    assert trained(tiny_tokenizer, rejected_t) == "No.<|im_end|>"
    for ids, targets in sequences(row):
        check_targets(ids, targets)
    assert len(row["input_ids"]) == len(row["targets"]) == len(chosen_ids) + len(rejected_ids)
    assert "1 pairs in 1 rows" in data.report.format()


CHAT_PROMPT = [user("Hi"), bot("Hello!"), user("Who are you?")]
SHAREGPT_PROMPT = [
    {"from": "human", "value": "Hi"},
    {"from": "gpt", "value": "Hello!"},
    {"from": "human", "value": "Who are you?"},
]


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        # TRL conversational, explicit prompt
        ({"prompt": CHAT_PROMPT, "chosen": [bot("I am Keel.")], "rejected": [bot("No.")]}, "auto"),
        # TRL implicit prompt: whole conversations sharing everything but the last answer
        (
            {"chosen": [*CHAT_PROMPT, bot("I am Keel.")], "rejected": [*CHAT_PROMPT, bot("No.")]},
            "auto",
        ),
        # answers holding more turns: the shared part joins the prompt
        (
            {
                "prompt": CHAT_PROMPT[:1],
                "chosen": [*CHAT_PROMPT[1:], bot("I am Keel.")],
                "rejected": [*CHAT_PROMPT[1:], bot("No.")],
            },
            "preference",
        ),
        # LLaMA-Factory ranking sharegpt: the conversation ends with the user, answers objects
        (
            {
                "conversations": SHAREGPT_PROMPT,
                "chosen": {"from": "gpt", "value": "I am Keel."},
                "rejected": {"from": "gpt", "value": "No."},
            },
            "auto",
        ),
        # the same with OpenAI messages
        (
            {"messages": CHAT_PROMPT, "chosen": bot("I am Keel."), "rejected": bot("No.")},
            "auto",
        ),
        # LLaMA-Factory ranking alpaca with history
        (
            {
                "instruction": "Who are you?",
                "input": "",
                "history": [["Hi", "Hello!"]],
                "chosen": "I am Keel.",
                "rejected": "No.",
            },
            "auto",
        ),
    ],
)
def test_pair_formats_give_the_same_rows(run, tiny_tokenizer, encode, row, fmt):
    data = run([row], fmt=fmt, columns={"history": "history"} if "history" in row else None)
    (prepared,) = list(data.train)
    (chosen_ids, chosen_t), (rejected_ids, rejected_t) = sequences(prepared)
    assert chosen_ids == encode(*CHAT_PROMPT, bot("I am Keel."))
    assert rejected_ids == encode(*CHAT_PROMPT, bot("No."))
    # the earlier assistant turn is context: only the last answer is trained
    assert trained(tiny_tokenizer, chosen_t) == "I am Keel.<|im_end|>"
    assert trained(tiny_tokenizer, rejected_t) == "No.<|im_end|>"


def test_system_column_and_message_replace_the_default_system_prompt(run, encode):
    rows = [{"system": "Be brief.", **trl_pair(0, chosen="Yes.", rejected="No.")}]
    (row,) = list(run(rows).train)
    (chosen_ids, _), _ = sequences(row)
    assert chosen_ids == encode(
        {"role": "system", "content": "Be brief."}, user("question 0"), bot("Yes.")
    )


def test_cache_fingerprint_depends_on_the_stage(run):
    dpo, orpo = run(PAIRS), run(PAIRS, stage="orpo")
    assert dpo.fingerprint != orpo.fingerprint and not orpo.from_cache
    assert [dict(r) for r in dpo.train] == [dict(r) for r in orpo.train]
    assert run(PAIRS).from_cache


# --- KTO ------------------------------------------------------------------------------------


def test_kto_rows_labels_and_kl_sequences(run, tiny_tokenizer, encode):
    data = run(SAMPLES[:3], stage="kto")
    rows = list(data.train)
    assert [r["labels"] for r in rows] == [[1], [0], [1]]
    assert all(r["num_targets"] == 1 for r in rows)
    parts = []
    for i, row in enumerate(rows):
        ((ids, targets),) = sequences(row)
        sample = SAMPLES[i]
        assert ids == encode(user(sample["prompt"]), bot(sample["completion"]))
        assert trained(tiny_tokenizer, targets) == sample["completion"] + "<|im_end|>"
        prompt_len = len(encode(user(sample["prompt"]), bot("x"))) - 3  # "x", EOS, "\n"
        assert tiny_tokenizer.decode(ids[prompt_len:]).startswith(sample["completion"])
        parts.append((ids[:prompt_len], ids[prompt_len:]))
    for i, row in enumerate(rows):
        ((kl_ids, kl_targets),) = sequences(row, "kl_")
        j = (i + 1) % 3  # the next sample's answer after this sample's prompt
        assert kl_ids == parts[i][0] + parts[j][1]
        assert trained(tiny_tokenizer, kl_targets) == SAMPLES[j]["completion"] + "<|im_end|>"
        check_targets(kl_ids, kl_targets)
    assert "3 samples (2 desirable, 1 undesirable) in 3 rows" in data.report.format()


@pytest.mark.parametrize(
    ("rows", "columns"),
    [
        (  # TRL conversational
            [
                {"prompt": [user(s["prompt"])], "completion": [bot(s["completion"])]}
                | {"label": s["label"]}
                for s in SAMPLES[:3]
            ],
            None,
        ),
        (  # LLaMA-Factory kto_en_demo: messages ending with the answer, label column
            [
                {"messages": [user(s["prompt"]), bot(s["completion"])], "label": s["label"]}
                for s in SAMPLES[:3]
            ],
            None,
        ),
        (  # alpaca + kto_tag
            [
                {"instruction": s["prompt"], "output": s["completion"], "kto_tag": s["label"]}
                for s in SAMPLES[:3]
            ],
            None,
        ),
        (  # renamed columns
            [{"q": s["prompt"], "a": s["completion"], "ok": s["label"]} for s in SAMPLES[:3]],
            {"prompt": "q", "response": "a", "kto_tag": "ok"},
        ),
    ],
)
def test_kto_formats_give_the_same_rows(run, rows, columns):
    reference = [dict(r) for r in run(SAMPLES[:3], stage="kto").train]
    data = run(rows, stage="kto", path="other.jsonl", columns=columns)
    assert [dict(r) for r in data.train] == reference


def test_kto_needs_two_samples(run):
    with pytest.raises(DataError, match="at least 2 usable samples"):
        run(SAMPLES[:1], stage="kto")


def test_kto_with_one_label_notes_it(run):
    run([kto_row(i, label=True) for i in range(3)], stage="kto")
    assert any("every KTO sample is desirable" in line for line in run.logs)


# --- rejections -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"prompt": "q", "chosen": "a"}, "prompt-only row: missing field 'rejected'"),
        ({"prompt": "q"}, "prompt-only row: missing field 'chosen'"),
        (trl_pair(0, chosen=""), "empty chosen answer"),
        (trl_pair(0, rejected=" "), "empty rejected answer"),
        (trl_pair(0, chosen="same", rejected="same"), "chosen and rejected answers are identical"),
        ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "empty user message"),
    ],
)
def test_pair_rejections_name_file_row_and_reason(run, bad, reason):
    with pytest.raises(DataError) as err:
        run([*PAIRS[:2], bad, PAIRS[2]])
    assert f"d.jsonl row 3: {reason}" in str(err.value)
    data = run([*PAIRS[:2], bad, PAIRS[2]], on_invalid="skip")
    assert len(data.train) == 3 and data.report.files[0].rejected == 1


GOOD_CHAT = {"prompt": [user("q")], "chosen": [bot("yes")], "rejected": [bot("no")]}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (
            {"prompt": [user("q"), bot("a")], "chosen": [bot("yes")], "rejected": [bot("no")]},
            "wrong role order: the prompt ends with assistant",
        ),
        (
            {"prompt": [user("q"), user("q")], "chosen": [bot("yes")], "rejected": [bot("no")]},
            "wrong role order: message 2 is user, expected assistant",
        ),
        (
            {"prompt": [bot("a")], "chosen": [user("yes")], "rejected": [user("no")]},
            "wrong role order: the conversation of 'chosen' ends with user",
        ),
        (
            {"chosen": [user("q"), bot("yes")], "rejected": [user("other q"), bot("no")]},
            "'chosen' and 'rejected' differ before their last assistant message",
        ),
        (
            {"prompt": [{"role": "user"}], "chosen": [bot("yes")], "rejected": [bot("no")]},
            "message 1: missing field 'content'",
        ),
    ],
)
def test_conversational_pair_rejections(run, bad, reason):
    with pytest.raises(DataError, match=f"d.jsonl row 2: {reason}"):
        run([GOOD_CHAT, bad])


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            "the prompt ends with assistant",
        ),
        ({"chosen": {"from": "human", "value": "yes"}}, "field 'chosen' is a user message"),
        ({"rejected": {"from": "function_call", "value": "{}"}}, "tool/function-call turn"),
    ],
)
def test_sharegpt_ranking_rejections(run, bad, reason):
    good = {
        "conversations": [{"from": "human", "value": "q"}],
        "chosen": {"from": "gpt", "value": "yes"},
        "rejected": {"from": "gpt", "value": "no"},
    }
    with pytest.raises(DataError, match=f"d.jsonl row 2: .*{reason}"):
        run([good, good | bad])


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([*SAMPLES[:2], kto_row(2, label=None) | {"label": None}], "row 3: missing field 'label'"),
        (
            [kto_row(i, label="true") for i in range(3)],
            "row 1: field 'label' must be true or false, got str 'true'",
        ),
        (
            [kto_row(i, label=1) for i in range(3)],
            "row 1: field 'label' must be true or false, got int 1",
        ),
        ([*SAMPLES[:2], kto_row(2) | {"completion": ""}], "row 3: empty completion"),
        (
            [*SAMPLES[:2], kto_row(2) | {"completion": None}],
            "row 3: prompt-only row: missing field 'completion'",
        ),
    ],
)
def test_kto_rejections(run, rows, reason):
    with pytest.raises(DataError) as err:
        run(rows, stage="kto")
    assert f"d.jsonl {reason}" in str(err.value)


# --- over length ------------------------------------------------------------------------------


LONG = trl_pair(9, rejected="long answer " * 40)
LONG_PROMPT = {"prompt": "question " * 40, "chosen": "yes", "rejected": "no"}


def test_overlength_drop_and_error_apply_to_the_pair(run):
    data = run([*PAIRS[:3], LONG], cutoff_len=64)
    assert len(data.train) == 3 and data.report.files[0].dropped == 1
    with pytest.raises(DataError) as err:
        run([*PAIRS[:3], LONG], cutoff_len=64, overlength="error")
    assert "1 row(s) longer than data.cutoff_len=64" in str(err.value)
    assert "d.jsonl row 4:" in str(err.value)


def test_truncate_cuts_only_the_answer(run, tiny_tokenizer, encode):
    data = run([LONG], cutoff_len=64, overlength="truncate")
    (row,) = list(data.train)
    (chosen_ids, chosen_t), (rejected_ids, rejected_t) = sequences(row)
    assert chosen_ids == encode(user("question 9"), bot(LONG["chosen"]))  # short: not cut
    full = encode(user("question 9"), bot(LONG["rejected"]))
    assert len(rejected_ids) == 64 and rejected_ids == full[:64]  # the prompt kept whole
    assert trained(tiny_tokenizer, rejected_t).startswith("long answer")
    check_targets(rejected_ids, rejected_t)
    assert data.report.files[0].truncated == 1


def test_truncate_never_cuts_the_prompt(run, encode):
    prompt_len = len(encode(user(LONG_PROMPT["prompt"]), bot("x"))) - 3
    with pytest.raises(DataError) as err:
        run([PAIRS[0], LONG_PROMPT], cutoff_len=48, overlength="truncate")
    message = str(err.value)
    assert f"d.jsonl row 2: the prompt alone is {prompt_len} tokens" in message
    assert "cutoff_len 48" in message


def test_kto_truncate_cuts_answers_of_samples_and_kl_sequences(run):
    rows = [kto_row(0), kto_row(1) | {"completion": "long answer " * 40}]
    data = run(rows, stage="kto", cutoff_len=48, overlength="truncate")
    for row in data.train:
        assert len(row["input_ids"]) <= 48 and len(row["kl_input_ids"]) <= 48
        for ids, targets in sequences(row, "kl_"):
            check_targets(ids, targets)
            assert any(t != IGNORE for t in targets)
    assert len(data.train[0]["kl_input_ids"]) == 48  # sample 0's prompt + the long answer


# --- packing and the split ----------------------------------------------------------------------


def pairs_of(rows) -> list[tuple]:
    out = []
    for row in rows:
        seqs = sequences(row)
        assert row["labels"] == [1, 0] * (len(seqs) // 2)
        assert row["num_targets"] == len(seqs) // 2
        out += [
            (tuple(seqs[k][0]), tuple(seqs[k][1]), tuple(seqs[k + 1][0]), tuple(seqs[k + 1][1]))
            for k in range(0, len(seqs), 2)
        ]
    return sorted(out)


def test_packing_keeps_pairs_whole(run):
    rows = [trl_pair(i) for i in range(20)]
    plain = run(rows, cutoff_len=128)
    packed = run(rows, cutoff_len=128, packing=True)
    assert len(packed.train) < len(plain.train)
    assert all(len(r["input_ids"]) <= 256 for r in packed.train)  # 2 x cutoff_len
    assert pairs_of(packed.train) == pairs_of(plain.train)
    assert packed.report.train.samples == 20 and packed.report.train.rows == len(packed.train)
    assert packed.report.train.targets == plain.report.train.targets


def test_packing_kto_keeps_each_kl_sequence_with_its_sample(run):
    rows = [kto_row(i) for i in range(12)]
    plain = run(rows, stage="kto", cutoff_len=128)
    kl_of = {tuple(r["input_ids"]): tuple(r["kl_input_ids"]) for r in plain.train}
    packed = run(rows, stage="kto", cutoff_len=128, packing=True)
    assert len(packed.train) < len(plain.train)
    seen = 0
    for row in packed.train:
        assert len(row["input_ids"]) <= 128 and len(row["kl_input_ids"]) <= 128
        samples, kls = sequences(row), sequences(row, "kl_")
        assert len(samples) == len(kls) == len(row["labels"]) == row["num_targets"]
        for (ids, _), (kl_ids, _) in zip(samples, kls):
            assert kl_of[tuple(ids)] == tuple(kl_ids)
            seen += 1
    assert seen == 12


def test_val_size_splits_pairs(run):
    rows = [trl_pair(i) for i in range(10)]
    data = run(rows, val_size=3)
    assert (len(data.train), len(data.eval)) == (7, 3)
    assert pairs_of([*data.train, *data.eval]) == pairs_of(run(rows).train)
    assert "eval: 3 pairs in 3 rows" in data.report.format()


# --- data for another stage -----------------------------------------------------------------------


SFT_ROWS = [{"messages": [user("q"), bot("a")]}, {"instruction": "q", "output": "a"}]


@pytest.mark.parametrize("stage", ["dpo", "kto"])
@pytest.mark.parametrize("sft_row", SFT_ROWS)
def test_sft_data_in_a_preference_stage_is_refused_with_the_fix(run, stage, sft_row):
    with pytest.raises(DataError) as err:
        run([sft_row], stage=stage)
    message = str(err.value)
    assert f"train.stage {stage} needs" in message and "use train.stage sft" in message


@pytest.mark.parametrize(
    ("rows", "stage", "fix"),
    [
        (PAIRS, "sft", "dpo, orpo, simpo or rm"),
        (PAIRS, "pt", "dpo, orpo, simpo or rm"),
        (SAMPLES, "sft", "train.stage to kto"),
        (
            [
                {"conversations": SHAREGPT_PROMPT[:1], "chosen": {"from": "gpt", "value": "a"}}
                | {"rejected": {"from": "gpt", "value": "b"}}
            ],
            "sft",
            "dpo, orpo, simpo or rm",
        ),
    ],
)
def test_preference_data_in_sft_or_pt_is_refused_with_the_fix(run, rows, stage, fix):
    with pytest.raises(DataError, match=fix):
        run(rows, stage=stage)


@pytest.mark.parametrize(
    ("fmt", "stage"), [("preference", "sft"), ("preference", "kto"), ("kto", "dpo")]
)
def test_explicit_preference_format_needs_its_stage(run, fmt, stage):
    with pytest.raises(DataError, match=f"format {fmt} holds"):
        run(PAIRS if fmt == "preference" else SAMPLES, stage=stage, fmt=fmt)


def test_text_is_refused_in_a_preference_stage(run):
    with pytest.raises(DataError, match="plain text"):
        run([{"text": "hello"}], stage="dpo", fmt="text")


@pytest.mark.parametrize(
    ("fmt", "stage", "problem"),
    [
        ("preference", "sft", "data.datasets.0.format = preference holds pairs"),
        ("kto", "orpo", "data.datasets.0.format = kto holds labelled samples"),
        ("text", "dpo", "data.datasets.0.format = text has no assistant turns"),
    ],
)
def test_config_check_refuses_a_format_for_another_stage(fmt, stage, problem):
    from keel.config.schema import ModelConfig, OutputConfig, RunConfig, TrainConfig
    from keel.config.validate import check_config

    cfg = RunConfig(
        model=ModelConfig(path="bundled:smollm2-135m-instruct"),
        data=DataConfig(datasets=[DatasetConfig(path="d.jsonl", format=fmt)]),
        output=OutputConfig(dir="out"),
        train=TrainConfig(stage=stage),
    )
    assert any(p.startswith(problem) for p in check_config(cfg))
    cfg.train.stage = {"preference": "dpo", "kto": "kto", "text": "pt"}[fmt]
    assert not any("format" in p for p in check_config(cfg))
