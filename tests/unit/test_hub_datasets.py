"""Datasets named by a Hugging Face Hub id (`data.datasets.N.path: owner/name`), read from a
hub cache laid out as huggingface_hub lays it out. HF_HUB_OFFLINE is on in every test."""

import json

import pytest
from hub_support import COMMIT, add_snapshot

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import prepare_data
from keel.errors import DataError

REPO = "tiny-org/tiny-alpaca"
NEWER = "fedcba9876543210fedcba9876543210fedcba98"


def _rows(prefix, n):
    return [
        {"instruction": f"{prefix} {i}?", "input": "", "output": f"{prefix} {i}."} for i in range(n)
    ]


def _repo(tmp_path, files: dict[str, list[dict] | str]):
    """A dataset repo's files: JSONL from rows, or text as given."""
    src = tmp_path / "repo-src"
    for name, content in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (
            content if isinstance(content, str) else "".join(json.dumps(r) + "\n" for r in content)
        )
        path.write_text(text)
    return src


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty offline hub cache (huggingface_hub read its constants at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


@pytest.fixture
def cached(hub_cache, tmp_path):
    """tiny-org/tiny-alpaca at COMMIT: 5 train rows, 2 test rows (datasets' split names)."""
    src = _repo(
        tmp_path, {"data/train.jsonl": _rows("train", 5), "data/test.jsonl": _rows("test", 2)}
    )
    return add_snapshot(hub_cache, REPO, src, repo_type="dataset")


@pytest.fixture
def prepare(tiny_tokenizer, tmp_path):
    """prepare(DatasetConfig or path, **data) -> (PreparedData, decoded rows, log lines)."""

    def run(dataset, **data):
        dataset = dataset if isinstance(dataset, DatasetConfig) else DatasetConfig(path=dataset)
        lines = []
        prepared = prepare_data(
            DataConfig(datasets=[dataset], **data),
            tiny_tokenizer,
            stage="sft",
            cache_dir=tmp_path / "cache",
            base_dir=tmp_path,
            seed=0,
            log=lines.append,
        )
        decoded = [tiny_tokenizer.decode(r["input_ids"]) for r in prepared.train]
        return prepared, decoded, lines

    return run


def test_load_dataset_by_name_offline_does_not_read_the_hub_cache(cached, monkeypatch):
    """Why keel reads the snapshot itself: datasets 5.2 offline only finds Arrow copies it
    prepared online before (CachedDatasetModuleFactory), never the hub cache's files."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError):
        datasets.load_dataset(REPO, split="train")


def test_a_hub_dataset_trains_its_train_split(cached, prepare):
    prepared, texts, lines = prepare(REPO)
    assert len(texts) == 5 and all("train" in t and "test" not in t for t in texts)
    assert [f.file for f in prepared.report.files] == [f"{REPO}/data/train.jsonl"]
    assert any(COMMIT in line and "revision main" in line for line in lines)


def test_the_repo_splits_and_slices(cached, prepare):
    _, texts, _ = prepare(DatasetConfig(path=REPO, split="test"))
    assert sorted(texts) == sorted(t for t in texts if "test" in t) and len(texts) == 2
    _, texts, _ = prepare(DatasetConfig(path=REPO, split="train[:2]+test[-1:]"))
    assert len(texts) == 3 and sum("test 1?" in t for t in texts) == 1
    with pytest.raises(DataError, match=r"split 'validation' cannot be used.*train, test"):
        prepare(DatasetConfig(path=REPO, split="validation"))


def test_the_readme_configs_choose_the_files(hub_cache, tmp_path, prepare):
    """The card's `configs:` maps files to splits, as `load_dataset` reads it."""
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: raw/b.jsonl\n---\n"
    src = _repo(
        tmp_path, {"README.md": card, "raw/a.jsonl": _rows("a", 3), "raw/b.jsonl": _rows("b", 2)}
    )
    add_snapshot(hub_cache, REPO, src, repo_type="dataset")
    _, texts, _ = prepare(REPO)
    assert len(texts) == 2 and all("user\nb " in t for t in texts)


def test_named_files_of_the_repo_are_its_train_split(hub_cache, tmp_path, prepare):
    """data.datasets[].files (Axolotl's data_files): these files, whatever the card says."""
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: raw/b.jsonl\n---\n"
    files = {"README.md": card, "raw/a.jsonl": _rows("a", 3), "raw/b.jsonl": _rows("b", 2)}
    add_snapshot(
        hub_cache, REPO, _repo(tmp_path, files | {"c/d.jsonl": _rows("d", 4)}), repo_type="dataset"
    )
    named, texts, lines = prepare(DatasetConfig(path=REPO, files=["c/d.jsonl"]))
    assert len(texts) == 4 and all("user\nd " in t for t in texts)
    assert [f.file for f in named.report.files] == [f"{REPO}/c/d.jsonl"]
    assert any("files ('c/d.jsonl',)" in line for line in lines)
    _, texts, _ = prepare(DatasetConfig(path=REPO, files=["raw/*.jsonl"]))
    assert len(texts) == 5  # a pattern: a.jsonl and b.jsonl
    card_only, texts, _ = prepare(REPO)  # the negative control: the card's b.jsonl alone
    assert len(texts) == 2 and card_only.fingerprint != named.fingerprint
    with pytest.raises(DataError, match=r"has no file matching 'c/e.jsonl' \(files\)"):
        prepare(DatasetConfig(path=REPO, files=["c/e.jsonl"]))


def test_a_repo_of_compressed_files_is_read_by_the_file_name_conventions(
    hub_cache, tmp_path, prepare
):
    import gzip

    rows = "".join(json.dumps(r) + "\n" for r in _rows("gz", 3)).encode()
    src = _repo(tmp_path, {"data/train.jsonl.gz": ""})
    (src / "data/train.jsonl.gz").write_bytes(gzip.compress(rows))
    add_snapshot(hub_cache, REPO, src, repo_type="dataset")
    prepared, texts, _ = prepare(REPO)
    assert len(texts) == 3 and all("user\ngz " in t for t in texts)
    assert [f.file for f in prepared.report.files] == [f"{REPO}/data/train.jsonl.gz"]


def test_online_only_the_chosen_configurations_files_are_downloaded(tmp_path, monkeypatch):
    """A corpus repo (fineweb-edu's layout) holds terabytes beyond the configuration a run
    reads: the file list and the card decide what is fetched, as datasets resolves it."""
    from huggingface_hub import constants

    from keel.data import hub
    from keel.hub_cache import HubRepo

    card = tmp_path / "README.md"
    card.write_text(
        "---\nconfigs:\n- config_name: default\n  data_files: data/*/*.parquet\n"
        "- config_name: sample-10BT\n  data_files: sample/10BT/*.parquet\n---\n"
    )
    listing = [
        "README.md", ".gitattributes", "data/CC-2013/000.parquet", "data/CC-2024/000.parquet",
        "sample/10BT/000.parquet", "sample/10BT/001.parquet", "sample/100BT/000.parquet",
    ]  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "repo_listing", lambda repo: (listing, card))
    repo = HubRepo(REPO, "main", kind="dataset", key="data.datasets.0", local="file or folder")
    sample = hub._files_to_fetch(repo, "here", hub.HubPart("sample-10BT"))
    assert sample == ("sample/10BT/000.parquet", "sample/10BT/001.parquet", "README.md")
    default = hub._files_to_fetch(repo, "here", hub.HubPart())
    assert default == ("data/CC-2013/000.parquet", "data/CC-2024/000.parquet", "README.md")
    plain = ["data/train-0.jsonl", "data/train-1.jsonl", "data/test.jsonl", "raw/dump.parquet"]
    monkeypatch.setattr(hub, "repo_listing", lambda repo: (plain, None))
    conventions = hub._files_to_fetch(repo, "here", hub.HubPart())  # no card: file names
    assert conventions == (*sorted(plain[:3]), "README.md")

    def no_network(repo):
        import httpx

        raise httpx.ConnectError("Name or service not known")  # not an OSError

    monkeypatch.setattr(hub, "repo_listing", no_network)  # the cache answers, as before
    assert hub._files_to_fetch(repo, "here", hub.HubPart()) is None
    monkeypatch.setattr(hub, "repo_listing", lambda repo: (["notes.pdf"], None))
    with pytest.raises(DataError, match=rf"no data files keel can read in {REPO}@main"):
        hub._files_to_fetch(repo, "here", hub.HubPart())  # nothing to fetch: said at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline: the cache answers
    assert hub._files_to_fetch(repo, "here", hub.HubPart()) is None


def test_files_of_a_local_path_are_refused(tmp_path, prepare):
    (tmp_path / "local.jsonl").write_text(json.dumps(_rows("x", 1)[0]) + "\n")
    with pytest.raises(DataError, match=r"files = \['a.jsonl'\] applies to Hugging Face Hub"):
        prepare(DatasetConfig(path="local.jsonl", files=["a.jsonl"]))


def test_a_new_upstream_commit_prepares_again(cached, hub_cache, tmp_path, prepare):
    first, _, _ = prepare(REPO)
    assert prepare(REPO)[0].from_cache
    src = _repo(tmp_path, {"data/train.jsonl": _rows("newer", 3)})
    add_snapshot(hub_cache, REPO, src, commit=NEWER, repo_type="dataset")  # main moves on
    newer, texts, _ = prepare(REPO)
    assert newer.fingerprint != first.fingerprint and not newer.from_cache
    assert len(texts) == 3
    pinned, texts, _ = prepare(DatasetConfig(path=REPO, revision=COMMIT))
    assert pinned.fingerprint != newer.fingerprint and len(texts) == 5


def test_max_row_bytes_applies_to_hub_files(hub_cache, tmp_path, prepare):
    big = [{"instruction": "x" * 5000, "input": "", "output": "y"}]
    src = _repo(tmp_path, {"data/train.jsonl": _rows("ok", 2) + big})
    add_snapshot(hub_cache, REPO, src, repo_type="dataset")
    with pytest.raises(
        DataError, match=rf"{REPO}/data/train.jsonl: line 3 is larger than data.max_row_bytes"
    ):
        prepare(REPO, max_row_bytes=4096)


def test_missing_offline_says_it_is_not_in_the_cache(hub_cache, prepare):
    with pytest.raises(DataError) as caught:
        prepare("tiny-org/absent")
    message = str(caught.value)
    assert message.startswith("data.datasets[0] (tiny-org/absent): dataset tiny-org/absent")
    assert f"is not in the Hugging Face cache at {hub_cache}" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert "`hf download tiny-org/absent --repo-type dataset`" in message
    assert "point data.datasets.0.path at a local file or folder" in message


def test_a_missing_data_file_is_not_taken_for_a_hub_id(hub_cache, prepare):
    with pytest.raises(DataError, match=r"file not found: .*data/train\.jsonl"):
        prepare("data/train.jsonl")


def test_a_revision_needs_a_hub_id(hub_cache, tmp_path, prepare):
    (tmp_path / "d.jsonl").write_text(json.dumps(_rows("a", 1)[0]) + "\n")
    with pytest.raises(DataError, match=r"revision = 'v1' applies to Hugging Face Hub dataset"):
        prepare(DatasetConfig(path="d.jsonl", revision="v1"))


def test_the_fingerprint_is_the_commit_not_the_cache_path(cached, hub_cache, tmp_path, prepare):
    """The same commit in another HF_HOME reuses the prepared data; a new commit with the
    same bytes is a new dataset version (prepared again)."""
    import shutil

    from huggingface_hub import constants

    first = prepare(REPO)[0].fingerprint
    moved = tmp_path / "elsewhere" / "hub"
    shutil.copytree(hub_cache, moved, symlinks=True)
    shutil.rmtree(hub_cache)
    constants.HF_HUB_CACHE = str(moved)  # restored by the hub_cache fixture's monkeypatch
    assert prepare(REPO)[0].fingerprint == first
    files = {"data/train.jsonl": _rows("train", 5), "data/test.jsonl": _rows("test", 2)}
    add_snapshot(moved, REPO, _repo(tmp_path / "again", files), commit=NEWER, repo_type="dataset")
    assert prepare(REPO)[0].fingerprint != first


@pytest.mark.parametrize("command", ["chat", "serve", "export"])
def test_model_help_names_hub_ids(command):
    from keel.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    model = next(a for a in sub.choices[command]._actions if a.dest == "model")
    assert "Hugging Face Hub id (owner/name)" in model.help


def test_the_default_revision_and_subset_leave_the_data_fingerprint_as_it_was():
    """Checkpoints written before data.datasets[].revision and subset existed hold
    fingerprints without them: their defaults must not change them (they would no longer
    resume); a pin or a subset must."""
    from keel.config.schema import DatasetConfig
    from keel.data.cache import _entry_identity

    assert _entry_identity(DatasetConfig(path="train.json")) == {
        "path": "train.json", "format": "auto", "columns": {}, "tags": {}, "split": "train",
        "max_samples": None, "num_samples": None,
    }  # fmt: skip
    pinned = _entry_identity(DatasetConfig(path="owner/name", revision="abc123", subset="en"))
    assert pinned["revision"] == "abc123" and pinned["subset"] == "en"
    assert _entry_identity(DatasetConfig(path="owner/name", files=["a.jsonl"]))["files"] == [
        "a.jsonl"
    ]


def _info(tmp_path, entries: dict) -> None:
    (tmp_path / "lf").mkdir(exist_ok=True)
    (tmp_path / "lf" / "dataset_info.json").write_text(json.dumps(entries))


def test_a_dataset_info_entry_by_hf_hub_url_reads_the_hub_dataset(cached, tmp_path, prepare):
    """LLaMA-Factory's `hf_hub_url` entries (its shipped alpaca_en, ...): the hub dataset,
    read with the entry's columns and split, as LLaMA-Factory's loader reads it."""
    _info(tmp_path, {"tiny": {"hf_hub_url": REPO, "split": "test",
                              "columns": {"prompt": "instruction", "response": "output"}}})  # fmt: skip
    data, texts, lines = prepare("tiny", dataset_dir="lf")
    assert len(texts) == 2 and all("user\ntest " in t for t in texts)
    assert any(f"Hugging Face dataset {REPO} at commit {COMMIT}" in line for line in lines)
    _info(tmp_path, {"tiny": {"hf_hub_url": REPO, "split": "train"}})  # the entry is the data
    again, texts, _ = prepare("tiny", dataset_dir="lf")
    assert len(texts) == 5 and again.fingerprint != data.fingerprint


def test_a_subset_or_folder_chooses_the_part_of_the_repo(hub_cache, tmp_path, prepare):
    card = (
        "---\nconfigs:\n- config_name: easy\n  data_files: easy/*.jsonl\n  default: true\n"
        "- config_name: hard\n  data_files: hard/*.jsonl\n---\n"
    )
    files = {"README.md": card, "easy/a.jsonl": _rows("easy", 3), "hard/a.jsonl": _rows("hard", 2)}
    add_snapshot(hub_cache, REPO, _repo(tmp_path, files), repo_type="dataset")
    _, texts, _ = prepare(REPO)  # the card's default
    assert len(texts) == 3 and all("user\neasy " in t for t in texts)
    _, texts, lines = prepare(DatasetConfig(path=REPO, subset="hard"))
    assert len(texts) == 2 and all("user\nhard " in t for t in texts)
    assert any("subset 'hard'" in line for line in lines)
    _info(tmp_path, {"hard": {"hf_hub_url": REPO, "subset": "hard"}})
    assert len(prepare("hard", dataset_dir="lf")[1]) == 2
    with pytest.raises(DataError, match=r"subset 'medium' is not a configuration.*'easy', 'hard'"):
        prepare(DatasetConfig(path=REPO, subset="medium"))

    folders = {"python/a.jsonl": _rows("py", 4), "go/a.jsonl": _rows("go", 1)}
    add_snapshot(hub_cache, "tiny-org/code", _repo(tmp_path / "code", folders), repo_type="dataset")
    _info(tmp_path, {"py": {"hf_hub_url": "tiny-org/code", "folder": "python"},
                     "rust": {"hf_hub_url": "tiny-org/code", "folder": "rust"}})  # fmt: skip
    _, texts, _ = prepare("py", dataset_dir="lf")
    assert len(texts) == 4 and all("user\npy " in t for t in texts)
    with pytest.raises(DataError, match=r"\(rust\): the dataset has no folder 'rust'"):
        prepare("rust", dataset_dir="lf")


def test_entries_keel_cannot_fetch_name_the_fix_and_a_local_subset_is_refused(
    hub_cache, tmp_path, prepare
):
    _info(tmp_path, {"ms": {"ms_hub_url": "AI-ModelScope/alpaca-gpt4-data-zh"},
                     "absent": {"hf_hub_url": "tiny-org/absent"}})  # fmt: skip
    with pytest.raises(DataError, match=r"'ms' has no file_name \(ms_hub_url: .*\"hf_hub_url\""):
        prepare("ms", dataset_dir="lf")
    with pytest.raises(DataError, match=r"tiny-org/absent.*not in the Hugging Face cache"):
        prepare("absent", dataset_dir="lf")
    (tmp_path / "local.jsonl").write_text(json.dumps(_rows("x", 1)[0]) + "\n")
    with pytest.raises(DataError, match=r"subset = 'en' applies to Hugging Face Hub datasets"):
        prepare(DatasetConfig(path="local.jsonl", subset="en"))


def test_a_hub_dataset_streams_from_the_hub_cache(cached, prepare, tiny_tokenizer, tmp_path):
    """data.streaming reads the split's files of the cached snapshot as prepared data does."""
    from keel.data.stream import prepare_stream

    prepared, _, _ = prepare(REPO, shuffle=False)
    config = DataConfig(datasets=[DatasetConfig(path=REPO)], shuffle=False, streaming=True)
    where = {"stage": "sft", "cache_dir": tmp_path / "cache", "base_dir": tmp_path, "seed": 0}
    lines: list[str] = []
    streamed = prepare_stream(config, tiny_tokenizer, **where, log=lines.append)
    assert [f.label for f in streamed.files] == [f"{REPO}/data/train.jsonl"]
    rows = streamed.open(lines.append).take(len(prepared.train))
    assert rows == [dict(row) for row in prepared.train]
