"""`data.datasets.0.path: owner/name` through the real CLI, offline, from a hub cache laid out
as huggingface_hub lays it out (HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1: no network)."""

import json

import pytest
from hub_support import COMMIT, add_snapshot, keel_offline_commands

REPO = "tiny-org/tiny-alpaca"


@pytest.fixture
def hf_home(tmp_path, data_file):
    """The conftest's 16 alpaca rows as the train split of tiny-org/tiny-alpaca."""
    home, src = tmp_path / "hf", tmp_path / "repo-src"
    (src / "data").mkdir(parents=True)
    rows = json.loads(data_file.read_text())
    (src / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    add_snapshot(home / "hub", REPO, src, repo_type="dataset")
    return home


def _config(tmp_path, model_dir):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model: {{path: {model_dir}, cache_dir: {tmp_path / 'kc'}}}\n"
        "method: {type: lora}\n"
        "data: {datasets: [{path: local.jsonl, format: alpaca}]}\n"
        "train: {max_steps: 2, precision: fp32, threads: 1, micro_batch_size: 4}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\n"
    )
    return cfg


def test_validate_and_train_take_a_hub_dataset_and_a_missing_one_exits_2(
    hf_home, tmp_path, tiny_model_dir
):
    """In one interpreter (one set of library imports): validate and train by the dataset's
    hub id, then train by an id that is not in the cache."""
    cfg, hub = _config(tmp_path, tiny_model_dir), f"data.datasets.0.path={REPO}"
    validated, trained, missing = keel_offline_commands(
        ["validate", str(cfg), hub],
        ["train", str(cfg), hub],
        [
            "train",
            str(cfg),
            "data.datasets.0.path=tiny-org/absent",
            f"output.dir={tmp_path / 'o2'}",
        ],
        hf_home=hf_home,
    )
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert COMMIT in validated.stdout + validated.stderr
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: 2 steps" in trained.stdout + trained.stderr

    assert missing.returncode == 2, missing.stderr[-3000:]
    assert "Traceback" not in missing.stderr
    assert "dataset tiny-org/absent (revision main) is not a local file or folder" in (
        missing.stderr
    )
    assert "not in the Hugging Face cache" in missing.stderr
    assert "`hf download tiny-org/absent --repo-type dataset`" in missing.stderr
