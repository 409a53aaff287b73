"""Preference data from LLaMA-Factory's dataset_info.json (ranking and kto_tag entries, as its
data/README.md and converter.py read them) and the shipped example data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
LF_EXAMPLES = ROOT / "examples" / "data" / "llamafactory"
PREFERENCE_EXAMPLES = ROOT / "examples" / "data" / "preference"
IGNORE = -100
ROLE_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user"}
ROLE_TAGS["assistant_tag"] = "assistant"


@pytest.fixture
def prepare(tiny_tokenizer, tmp_path):
    """prepare(*names, stage=, dataset_dir=, **data) -> (PreparedData, [(text, trained)]),
    one (text, trained text) per sequence."""

    def run(*names, stage, dataset_dir=LF_EXAMPLES, **data):
        prepared = prepare_data(
            DataConfig(
                datasets=[DatasetConfig(path=n) for n in names],
                dataset_dir=str(dataset_dir),
                **data,
            ),
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda _: None,
        )
        return prepared, [seq for row in prepared.train for seq in _texts(tiny_tokenizer, row)]

    return run


def _texts(tokenizer, row) -> list[tuple[str, str]]:
    positions = row["position_ids"]
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    out = []
    for a, b in zip(starts, starts[1:]):
        trained = [t for t in row["targets"][a:b] if t != IGNORE]
        out.append((tokenizer.decode(row["input_ids"][a:b]), tokenizer.decode(trained)))
    return out


@pytest.fixture
def chat(tiny_tokenizer):
    def render(*messages):
        msgs = [{"role": r, "content": c} for r, c in messages]
        return tiny_tokenizer.apply_chat_template(msgs, tokenize=False)

    return render


# --- the shipped LLaMA-Factory folder -----------------------------------------------------------


def test_shipped_ranking_entries_load_for_dpo(prepare, chat):
    data, seqs = prepare("dpo_mini", "dpo_alpaca_mini", stage="dpo")
    assert [f.kept for f in data.report.files] == [6, 5] and data.report.num_rejected == 0
    assert len(seqs) == 22  # chosen and rejected of 11 pairs
    # dpo_mini row 3: a multi-turn conversation ending with the user; only the answer trains
    rows = json.loads((LF_EXAMPLES / "dpo_mini.json").read_text())
    turns = [
        ("user" if m["from"] == "human" else "assistant", m["value"])
        for m in rows[2]["conversations"]
    ]
    text, trained = seqs[4]
    assert text == chat(*turns, ("assistant", rows[2]["chosen"]["value"]))
    assert trained == rows[2]["chosen"]["value"] + "<|im_end|>"
    assert seqs[5][1] == rows[2]["rejected"]["value"] + "<|im_end|>"
    # dpo_alpaca_mini row 1: instruction and input joined by a newline, as LLaMA-Factory does
    alpaca = json.loads((LF_EXAMPLES / "dpo_alpaca_mini.json").read_text())[0]
    user = alpaca["instruction"] + "\n" + alpaca["input"]
    assert seqs[12][0] == chat(("user", user), ("assistant", alpaca["chosen"]))


def test_shipped_kto_entry_loads_for_kto(prepare):
    data, seqs = prepare("kto_mini", stage="kto")
    rows = json.loads((LF_EXAMPLES / "kto_mini.json").read_text())
    assert [r["labels"] for r in data.train] == [[int(r["label"])] for r in rows]
    assert [trained for _, trained in seqs] == [
        r["messages"][-1]["content"] + "<|im_end|>" for r in rows
    ]
    assert data.report.train.desirable == sum(r["label"] for r in rows)


@pytest.mark.parametrize(
    ("name", "stage", "reason"),
    [
        (
            "dpo_mini",
            "sft",
            "'dpo_mini' is preference data.*dpo, orpo, simpo or rm.*this run is train.stage sft",
        ),
        ("dpo_mini", "kto", "'dpo_mini' is preference data"),
        ("dpo_alpaca_mini", "pt", "'dpo_alpaca_mini' is preference data"),
        ("kto_mini", "sft", "'kto_mini' is KTO data.*train.stage kto"),
        ("kto_mini", "simpo", "'kto_mini' is KTO data"),
        ("alpaca_mini", "dpo", "'alpaca_mini' is not preference data.*ranking"),
        ("chat_mini", "kto", "'chat_mini' has no columns.kto_tag"),
    ],
)
def test_entries_are_refused_for_other_stages(prepare, name, stage, reason):
    with pytest.raises(DataError, match=reason):
        prepare(name, stage=stage)


# --- entry shapes of LLaMA-Factory's registry ---------------------------------------------------

PAIR = {"instruction": "Who are you?", "question": "Who are you?", "chosen": "I am Keel."}
PAIR |= {"rejected": "No.", "system": "Be brief."}
KTO = [
    {"prompt": "Who are you?", "completion": "I am Keel.", "label": True},
    {"prompt": "Hi", "completion": "Go away.", "label": False},
]


@pytest.fixture
def registry(tmp_path):
    lf = tmp_path / "lf"
    lf.mkdir()
    (lf / "pairs.json").write_text(json.dumps([PAIR]))
    (lf / "kto.json").write_text(json.dumps(KTO))
    chats = [
        {
            "completion": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["completion"]},
            ],
            "label": r["label"],
        }
        for r in KTO
    ]
    (lf / "kto_chat.json").write_text(json.dumps(chats))
    (lf / "kto_text_label.json").write_text(
        json.dumps([r | {"label": str(r["label"])} for r in KTO])
    )
    info = {
        "ultrafeedback": {
            "file_name": "pairs.json",
            "ranking": True,
            "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"},
        },
        "orca_pairs": {
            "file_name": "pairs.json",
            "ranking": True,
            "columns": {
                "prompt": "question",
                "chosen": "chosen",
                "rejected": "rejected",
                "system": "system",
            },
        },
        "nectar_rm": {"file_name": "pairs.json", "ranking": True},
        "ultrafeedback_kto": {
            "file_name": "kto.json",
            "columns": {"prompt": "prompt", "response": "completion", "kto_tag": "label"},
        },
        "kto_mix_en": {
            "file_name": "kto_chat.json",
            "formatting": "sharegpt",
            "columns": {"messages": "completion", "kto_tag": "label"},
            "tags": ROLE_TAGS,
        },
        "kto_text_label": {
            "file_name": "kto_text_label.json",
            "columns": {"prompt": "prompt", "response": "completion", "kto_tag": "label"},
        },
        "both": {
            "file_name": "pairs.json",
            "ranking": True,
            "columns": {"chosen": "chosen", "rejected": "rejected", "kto_tag": "label"},
        },
        "kto_no_response": {
            "file_name": "kto.json",
            "columns": {"prompt": "prompt", "kto_tag": "label"},
        },
    }
    (lf / "dataset_info.json").write_text(json.dumps(info))
    return lf


def test_alpaca_ranking_entries(registry, prepare, chat):
    _, seqs = prepare("ultrafeedback", stage="dpo", dataset_dir=registry)
    assert seqs == [  # no system: the entry does not name that column
        (chat(("user", "Who are you?"), ("assistant", "I am Keel.")), "I am Keel.<|im_end|>"),
        (chat(("user", "Who are you?"), ("assistant", "No.")), "No.<|im_end|>"),
    ]
    _, seqs = prepare("orca_pairs", stage="simpo", dataset_dir=registry)
    assert seqs[0][0] == chat(
        ("system", "Be brief."), ("user", "Who are you?"), ("assistant", "I am Keel.")
    )


def test_kto_entries(registry, prepare, chat):
    text_data, text_seqs = prepare("ultrafeedback_kto", stage="kto", dataset_dir=registry)
    chat_data, chat_seqs = prepare("kto_mix_en", stage="kto", dataset_dir=registry)
    assert text_seqs == chat_seqs
    assert text_seqs[0] == (
        chat(("user", "Who are you?"), ("assistant", "I am Keel.")),
        "I am Keel.<|im_end|>",
    )
    assert [r["labels"] for r in text_data.train] == [[1], [0]]


@pytest.mark.parametrize(
    ("name", "stage", "reason"),
    [
        (
            "nectar_rm",
            "dpo",
            "'nectar_rm' is ranking data but names no columns.chosen or columns.rejected",
        ),
        ("both", "dpo", "'both' has both ranking: true and columns.kto_tag"),
        ("kto_no_response", "kto", "'kto_no_response' names no columns.response"),
    ],
)
def test_malformed_preference_entries_are_refused(registry, prepare, name, stage, reason):
    with pytest.raises(DataError, match=reason):
        prepare(name, stage=stage, dataset_dir=registry)


def test_kto_tag_must_be_a_boolean(registry, prepare):
    # LLaMA-Factory reads a kto_tag only when it is a bool and drops the row otherwise
    with pytest.raises(
        DataError, match="row 1: field 'label' must be true or false, got str 'True'"
    ):
        prepare("kto_text_label", stage="kto", dataset_dir=registry)


# --- the shipped preference examples -------------------------------------------------------------


def _make_pairs():
    spec = importlib.util.spec_from_file_location(
        "make_pairs", PREFERENCE_EXAMPLES / "make_pairs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_files_are_what_the_script_writes():
    for name, rows in _make_pairs().build().items():
        lines = (PREFERENCE_EXAMPLES / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows, name


def test_example_pairs_teach_the_sign_off(tiny_tokenizer, tmp_path):
    def load(name: str, stage: str):
        return prepare_data(
            DataConfig(datasets=[DatasetConfig(path=str(PREFERENCE_EXAMPLES / name))]),
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lambda _: None,
        )

    train, heldout = load("train.jsonl", "dpo"), load("heldout.jsonl", "dpo")
    assert (train.report.train.samples, heldout.report.train.samples) == (96, 16)
    questions = {}
    for name, data in (("train", train), ("heldout", heldout)):
        questions[name] = set()
        for row in data.train:
            (chosen, chosen_trained), (_, rejected_trained) = _texts(tiny_tokenizer, row)
            assert chosen_trained.startswith("Sure! ")
            assert chosen_trained.endswith("Hope that helps!<|im_end|>")
            assert "Sure!" not in rejected_trained and "Hope that helps" not in rejected_trained
            questions[name].add(chosen.split("<|im_start|>user\n")[1].split("<|im_end|>")[0])
    assert len(questions["train"]) == 96 and not questions["train"] & questions["heldout"]
    kto = load("kto.jsonl", "kto")
    assert (kto.report.train.samples, kto.report.train.desirable) == (40, 20)
