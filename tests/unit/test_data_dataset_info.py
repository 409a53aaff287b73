"""LLaMA-Factory's dataset_info.json: every entry shape its data/dataset_info.json uses.

Each shape (keys, columns, tags) is copied from LLaMA-Factory's registry with tiny synthetic
files. An entry either loads as LLaMA-Factory reads it (the conversation or pretraining
text, and which tokens are trained, checked on the pipeline's rows) or is refused with a
message naming the entry and the reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import DataError

ALPACA = [  # the file holds system and history too: read only when the entry names them
    {
        "instruction": "Who are you?",
        "input": "",
        "output": "I am Keel.",
        "system": "Be brief.",
        "history": [["Hi", "Hello!"]],
    },
    {
        "instruction": "Translate to French:",
        "input": "hello world",
        "output": "Bonjour le monde.",
        "system": "",
        "history": [],
    },
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Who are you?"},
            {"from": "gpt", "value": "I am Keel."},
        ]
    }
]
OPENAI = [
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ]
    }
]
OPENAI_SYSTEM = [{"messages": [{"role": "system", "content": "Be brief."}, *OPENAI[0]["messages"]]}]
CORPUS = [{"text": f"doc {i}"} for i in range(10)]
ROLE_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user"}
ROLE_TAGS["assistant_tag"] = "assistant"

# name: (entry, {file: rows}); names and shapes follow LLaMA-Factory's data/dataset_info.json
REGISTRY = {
    # local entries of LLaMA-Factory's registry
    "identity": ({"file_name": "alpaca.json"}, {"alpaca.json": ALPACA}),
    "glaive_toolcall_en_demo": (
        {
            "file_name": "sharegpt.json",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "tools": "tools"},
        },
        {"sharegpt.json": SHAREGPT},
    ),
    **{
        name: (
            {
                "file_name": "openai.json",
                "formatting": "sharegpt",
                "columns": {"messages": "messages", **dict.fromkeys(media, "x")},
                "tags": ROLE_TAGS,
            },
            {"openai.json": OPENAI},
        )
        for name, media in [
            ("mllm_demo", ["images"]),
            ("mllm_audio_demo", ["audios"]),
            ("mllm_video_demo", ["videos"]),
            ("mllm_video_audio_demo", ["videos", "audios"]),
        ]
    },
    "dpo_en_demo": (
        {
            "file_name": "sharegpt.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        },
        {},
    ),
    "kto_en_demo": (
        {
            "file_name": "openai.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "kto_tag": "label"},
            "tags": ROLE_TAGS,
        },
        {},
    ),
    "wiki_demo": ({"file_name": "wiki.txt", "columns": {"prompt": "text"}}, {}),
    "c4_demo": ({"file_name": "c4.jsonl", "columns": {"prompt": "text"}}, {"c4.jsonl": CORPUS}),
    # hub entry shapes, pointed at a local file the way a user does after downloading
    "alpaca_en": ({"hf_hub_url": "llamafactory/alpaca_en"}, {}),
    "deepctrl": ({"ms_hub_url": "deepctrl/deepctrl-sft-data"}, {}),
    "om_only": ({"om_hub_url": "a/b"}, {}),
    "script_only": ({"script_url": "hh_rlhf_en"}, {}),
    "cloud_only": ({"cloud_file_name": "s3://bucket/data.json"}, {}),
    "mathinstruct": (
        {"file_name": "alpaca.json", "columns": {"prompt": "instruction", "response": "output"}},
        {},
    ),
    "openorca": (
        {
            "file_name": "alpaca.json",
            "columns": {"prompt": "instruction", "response": "output", "system": "system"},
        },
        {},
    ),
    "readme_alpaca": (  # data/README.md: the full alpaca description
        {
            "file_name": "alpaca.json",
            "columns": {
                "prompt": "instruction",
                "query": "input",
                "response": "output",
                "system": "system",
                "history": "history",
            },
        },
        {},
    ),
    "lima": ({"file_name": "sharegpt.json", "formatting": "sharegpt"}, {}),
    "sgsc_b2b_entities": (
        {"file_name": "from_value_messages.json", "formatting": "sharegpt"}
        | {"columns": {"messages": "messages"}},
        {"from_value_messages.json": [{"messages": SHAREGPT[0]["conversations"]}]},
    ),
    "ultrachat_200k": (
        {"file_name": "openai.json", "formatting": "sharegpt", "split": "train"}
        | {"columns": {"messages": "messages"}, "tags": ROLE_TAGS},
        {},
    ),
    "lmsys_system": (  # lmsys_chat's tags (no system_tag) on rows with a system message
        {"file_name": "openai_system.json", "formatting": "sharegpt"}
        | {"columns": {"messages": "messages"}, "tags": ROLE_TAGS},
        {"openai_system.json": OPENAI_SYSTEM},
    ),
    "open_thoughts": (
        {"file_name": "openai_system.json", "formatting": "sharegpt"}
        | {"columns": {"messages": "messages"}, "tags": {**ROLE_TAGS, "system_tag": "system"}},
        {},
    ),
    "adgen_eval": (
        {"file_name": "alpaca.json", "split": "validation"}
        | {"columns": {"prompt": "instruction", "response": "output"}},
        {},
    ),
    "redpajama_v2": ({"file_name": "c4.jsonl", "columns": {"prompt": "text"}, "subset": "en"}, {}),
    "starcoder_python": (
        {"file_name": "code", "columns": {"prompt": "content"}, "folder": "python"},
        {
            "code/python/a.jsonl": [{"content": "def f(): pass"}],
            "code/java/b.jsonl": [{"content": "class A {}"}],
        },
    ),
    "openai_formatting": (
        {"file_name": "openai.json", "formatting": "openai"}
        | {"columns": {"messages": "messages"}, "tags": ROLE_TAGS},
        {},
    ),
}


@pytest.fixture
def registry(tmp_path):
    lf = tmp_path / "lf"
    for _, files in REGISTRY.values():
        for name, rows in files.items():
            (lf / name).parent.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(r) + "\n" for r in rows)
            (lf / name).write_text(text if name.endswith(".jsonl") else json.dumps(rows))
    (lf / "wiki.txt").write_text("first document\n\nsecond document\n")
    write_info(lf, {name: entry for name, (entry, _) in REGISTRY.items()})
    return lf


def write_info(lf, info: dict) -> None:
    (lf / "dataset_info.json").write_text(json.dumps(info, indent=1))


@pytest.fixture
def prepare(tiny_tokenizer, tmp_path):
    """prepare(*names, stage=, seed=, **data) -> (PreparedData, [(text, trained text)])."""
    logs: list[str] = []

    def run(*datasets, stage="sft", seed=0, **data):
        configs = [d if isinstance(d, DatasetConfig) else DatasetConfig(path=d) for d in datasets]
        prepared = prepare_data(
            DataConfig(datasets=configs, dataset_dir="lf", **data),
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=seed,
            log=logs.append,
        )
        decode = tiny_tokenizer.decode
        rows = [
            (decode(r["input_ids"]), decode([t for t in r["targets"] if t != -100]))
            for r in prepared.train
        ]
        return prepared, rows

    run.logs = logs
    return run


@pytest.fixture
def chat(tiny_tokenizer):
    """chat(*messages as (role, content)) -> the conversation rendered by the template."""

    def render(*messages):
        msgs = [{"role": r, "content": c} for r, c in messages]
        return tiny_tokenizer.apply_chat_template(msgs, tokenize=False)

    return render


def refusal(prepare, name: str, stage: str = "sft") -> str:
    with pytest.raises(DataError) as err:
        prepare(name, stage=stage)
    message = str(err.value)
    assert f"entry '{name}'" in message, message  # names the entry
    return message


# --- alpaca -----------------------------------------------------------------------------


def test_alpaca_without_columns_reads_instruction_input_output_only(registry, prepare, chat):
    _, rows = prepare("identity")
    assert rows == [
        (chat(("user", "Who are you?"), ("assistant", "I am Keel.")), "I am Keel.<|im_end|>"),
        (
            chat(("user", "Translate to French:\nhello world"), ("assistant", "Bonjour le monde.")),
            "Bonjour le monde.<|im_end|>",
        ),
    ]  # no system, no history: an entry without columns does not name them


def test_alpaca_with_system_and_history_columns(registry, prepare, chat):
    _, rows = prepare("readme_alpaca")
    text, trained = rows[0]
    assert text == chat(
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Who are you?"),
        ("assistant", "I am Keel."),
    )
    assert trained == "Hello!<|im_end|>I am Keel.<|im_end|>"  # history answers are learned too


def test_alpaca_columns_replace_the_defaults(registry, prepare, chat):
    _, rows = prepare("mathinstruct")  # names prompt and response: 'input' is not read
    assert rows[1][0] == chat(("user", "Translate to French:"), ("assistant", "Bonjour le monde."))
    _, rows = prepare("openorca")  # system named: read, history still not
    assert rows[0][0] == chat(
        ("system", "Be brief."), ("user", "Who are you?"), ("assistant", "I am Keel.")
    )


# --- pretraining corpora ------------------------------------------------------------------


def test_corpus_entries_pretrain_on_the_prompt_column(registry, prepare):
    data, rows = prepare("c4_demo", "wiki_demo", stage="pt")
    expected = [f"doc {i}<|im_end|>" for i in range(10)]
    expected += ["first document<|im_end|>", "second document<|im_end|>"]
    assert [text for text, _ in rows] == expected
    for row in data.train:  # every next token is a target
        assert row["targets"] == row["input_ids"][1:] + [-100]


def test_corpus_entry_with_a_query_column_joins_prompt_and_query(registry, prepare):
    info = json.loads((registry / "dataset_info.json").read_text())
    info["qa_corpus"] = {"file_name": "alpaca.json", "columns": {"prompt": "instruction"}}
    info["qa_corpus"]["columns"]["query"] = "input"
    write_info(registry, info)
    _, rows = prepare("qa_corpus", stage="pt")
    assert [text for text, _ in rows] == [
        "Who are you?<|im_end|>",
        "Translate to French:\nhello world<|im_end|>",
    ]


def test_corpus_entry_is_refused_for_sft(registry, prepare):
    message = refusal(prepare, "c4_demo", stage="sft")
    assert "no response column" in message and "train.stage pt" in message


@pytest.mark.parametrize(
    ("name", "dropped"),
    [("identity", "response: 'output'"), ("readme_alpaca", "system: 'system', history")],
)
def test_instruction_entry_is_refused_for_pretraining(registry, prepare, name, dropped):
    message = refusal(prepare, name, stage="pt")
    assert dropped in message and "silently drops" in message and "train.stage sft" in message


# --- sharegpt -------------------------------------------------------------------------


def test_sharegpt_default_tags_multi_turn(registry, prepare, chat):
    for name in ("lima", "sgsc_b2b_entities"):  # conversations / messages column, from/value
        _, rows = prepare(name)
        assert rows == [
            (
                chat(
                    ("user", "Hi"),
                    ("assistant", "Hello!"),
                    ("user", "Who are you?"),
                    ("assistant", "I am Keel."),
                ),
                "Hello!<|im_end|>I am Keel.<|im_end|>",
            )
        ]


def test_sharegpt_custom_tags_and_system_tag(registry, prepare, chat):
    _, rows = prepare("ultrachat_200k")
    assert rows == [(chat(("user", "Hi"), ("assistant", "Hello!")), "Hello!<|im_end|>")]
    _, rows = prepare("open_thoughts")  # system_tag named: a leading system message is read
    assert rows[0][0] == chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"))
    # tags that name no system_tag replace the default one: LLaMA-Factory skips such rows
    with pytest.raises(DataError) as err:
        prepare("lmsys_system")
    assert "openai_system.json row 1: message 1 of 'messages': unknown role 'system'" in str(
        err.value
    )
    assert '"system_tag": "system"' in str(err.value)


def test_sharegpt_is_refused_for_pretraining(registry, prepare):
    message = refusal(prepare, "lima", stage="pt")
    assert "first user message" in message and "train.stage sft" in message


# --- refused shapes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("mllm_demo", "multimodal.*images"),
        ("mllm_audio_demo", "multimodal.*audios"),
        ("mllm_video_demo", "multimodal.*videos"),
        ("mllm_video_audio_demo", "multimodal.*videos"),
        ("dpo_en_demo", "preference data.*ranking"),
        ("kto_en_demo", "KTO.*preference stage"),
        ("deepctrl", "no file_name.*ms_hub_url"),
        ("om_only", "no file_name.*om_hub_url"),
        ("script_only", "no file_name.*script_url"),
        ("cloud_only", "no file_name.*cloud_file_name"),
        ("openai_formatting", "formatting 'openai'.*detailed thinking off.*sharegpt"),
        ("adgen_eval", "split 'validation'.*one split.*train\\[:1000\\]"),
    ],
)
def test_refused_entries_name_the_entry_and_the_reason(registry, prepare, name, reason):
    with pytest.raises(DataError, match=reason) as err:
        prepare(name)
    message = str(err.value)
    assert name in message, message


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"columns": {"prompt": "instruction", "respones": "output"}}, "did you mean 'response'"),
        ({"formatting": "sharegpt", "tags": {"content_tag": "value"}}, "tags.role_tag"),
        ({"formatting": "sharegpt", "columns": {}}, "columns.messages"),
        ({"formatting": "xml"}, "formatting 'xml' is unknown"),
        ({"num_samples": 0}, "num_samples must be a whole number > 0"),
    ],
)
def test_malformed_entries_are_refused(registry, prepare, entry, reason):
    write_info(registry, {"bad": {"file_name": "alpaca.json", **entry}})
    with pytest.raises(DataError, match=reason):
        prepare("bad")


# --- num_samples, split, folder, subset -----------------------------------------------------


def corpus_entry(registry, **extra) -> None:
    write_info(registry, {"c4": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}, **extra}})


def llamafactory_draws(seed: int, rows: int, *num_samples: int) -> list[list[int]]:
    """LLaMA-Factory's loader.py sampling, replayed: numpy's global generator after
    transformers.set_seed, one dataset after another."""
    import transformers

    transformers.set_seed(seed)
    draws = []
    for target in num_samples:
        indexes = np.random.permutation(rows)[:target]
        if target - len(indexes) > 0:
            indexes = np.concatenate((indexes, np.random.choice(rows, target - len(indexes))))
        draws.append(indexes.tolist())
    return draws


@pytest.mark.parametrize("num_samples", [4, 14])
def test_num_samples_draws_the_rows_llamafactory_draws(registry, prepare, num_samples):
    corpus_entry(registry, num_samples=num_samples)
    _, rows = prepare("c4", stage="pt", seed=7)
    picked = [int(text.removeprefix("doc ").removesuffix("<|im_end|>")) for text, _ in rows]
    assert picked == llamafactory_draws(7, 10, num_samples)[0]
    if num_samples > 10:  # every row once before any repeats
        assert set(picked) == set(range(10)) and len(picked) == 14
        assert any("num_samples 14 of 10 rows, 4 of them drawn again" in s for s in prepare.logs)
    _, again = prepare("c4", stage="pt", seed=7)
    assert again == rows  # deterministic given the seed
    _, other = prepare("c4", stage="pt", seed=8)
    assert other != rows  # and the seed matters


def test_num_samples_share_one_generator_across_datasets(registry, prepare):
    corpus_entry(registry, num_samples=3)
    second = DatasetConfig(path="c4", num_samples=5)  # the config's num_samples wins
    _, rows = prepare("c4", second, stage="pt", seed=3)
    picked = [int(text.removeprefix("doc ").removesuffix("<|im_end|>")) for text, _ in rows]
    first, then = llamafactory_draws(3, 10, 3, 5)
    assert picked == first + then


def test_max_samples_takes_the_first_rows_after_sampling(registry, prepare):
    corpus_entry(registry, num_samples=6)
    _, rows = prepare(DatasetConfig(path="c4", max_samples=2), stage="pt", seed=7)
    picked = [int(text.removeprefix("doc ").removesuffix("<|im_end|>")) for text, _ in rows]
    assert picked == llamafactory_draws(7, 10, 6)[0][:2]


@pytest.mark.parametrize(
    ("split", "expected"),
    [("train", range(10)), ("train[:3]", range(3)), ("train[80%:]", [8, 9])],
)
def test_split_of_a_local_file_is_train_or_a_slice(registry, prepare, split, expected):
    corpus_entry(registry, split=split)
    _, rows = prepare("c4", stage="pt")
    assert [text for text, _ in rows] == [f"doc {i}<|im_end|>" for i in expected]


def test_folder_selects_a_subfolder_of_a_folder_entry(registry, prepare):
    _, rows = prepare("starcoder_python", stage="pt")
    assert [text for text, _ in rows] == ["def f(): pass<|im_end|>"]
    entry = {"file_name": "code", "columns": {"prompt": "content"}}
    write_info(registry, {"code": entry, "go": {**entry, "folder": "go"}})
    _, rows = prepare("code", stage="pt")  # without folder: every file in the folder
    assert sorted(text for text, _ in rows) == ["class A {}<|im_end|>", "def f(): pass<|im_end|>"]
    with pytest.raises(DataError, match="entry 'go': folder 'go' not found"):
        prepare("go", stage="pt")


def test_subset_and_folder_on_a_file_are_ignored_with_a_note(registry, prepare):
    _, rows = prepare("redpajama_v2", stage="pt")
    assert len(rows) == 10  # the whole file, as LLaMA-Factory reads a local file
    assert any("entry 'redpajama_v2': subset 'en' is ignored" in s for s in prepare.logs)
    corpus_entry(registry, folder="python", hf_hub_url="allenai/c4")
    _, rows = prepare("c4", stage="pt")
    assert len(rows) == 10
    assert any("folder 'python' is ignored: file_name is a file" in s for s in prepare.logs)
    assert any("LLaMA-Factory would load allenai/c4" in s for s in prepare.logs)


def test_every_row_changing_key_is_in_the_cache_fingerprint(registry, prepare):
    corpus_entry(registry)
    base, _ = prepare("c4", stage="pt")
    seen = {base.fingerprint}
    for extra, count in (({"num_samples": 3}, 3), ({"split": "train[:5]"}, 5)):
        corpus_entry(registry, **extra)  # the entry changes, the data file does not
        data, rows = prepare("c4", stage="pt")
        assert not data.from_cache and data.fingerprint not in seen
        assert len(rows) == count
        seen.add(data.fingerprint)
    data, _ = prepare(DatasetConfig(path="c4", num_samples=4), stage="pt")
    assert not data.from_cache and data.fingerprint not in seen


def test_arrow_file_entry(registry, prepare, chat):
    from datasets import Dataset

    Dataset.from_list(ALPACA).save_to_disk(str(registry / "saved"))
    (arrow,) = (registry / "saved").glob("*.arrow")
    arrow.rename(registry / "alpaca.arrow")
    write_info(registry, {"arrow": {"file_name": "alpaca.arrow"}})
    _, rows = prepare("arrow")
    assert rows[0][1] == "I am Keel.<|im_end|>" and len(rows) == 2
