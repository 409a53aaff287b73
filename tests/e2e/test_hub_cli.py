"""`model.path: owner/name` through the CLI, offline, from a Hugging Face cache laid out
as huggingface_hub lays it out (HF_HUB_OFFLINE=1 in every subprocess: no network). Each test
runs its commands one after another in one interpreter (keel_offline_commands), which pays the
library imports once."""

import json

import pytest
from hub_support import COMMIT, add_snapshot, keel_offline_commands

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hf_home(tmp_path, tiny_model_dir):
    home = tmp_path / "hf"
    add_snapshot(home / "hub", REPO, tiny_model_dir)
    return home


def _config(tmp_path, data_file, model_path, name="run.yaml"):
    cfg = tmp_path / name
    cfg.write_text(
        f"model: {{path: {model_path}}}\n"
        "method: {type: lora}\n"
        f"data: {{datasets: [{{path: {data_file}, format: alpaca}}]}}\n"
        "train: {max_steps: 2, precision: fp32, threads: 1, micro_batch_size: 4}\n"
        f"output: {{dir: {tmp_path / 'out'}, save_every: 2}}\n"
    )
    return cfg


def test_train_chat_export_by_hub_id(hf_home, tmp_path, data_file):
    cfg, out = _config(tmp_path, data_file, REPO), tmp_path / "out"
    trained, chat, exported = keel_offline_commands(
        ["train", str(cfg), f"model.cache_dir={tmp_path / 'kc'}"],
        # the adapter finds its base by the id, in the cache
        ["chat", "--model", str(out), "--prompt", "hi", "--max-new-tokens", "2"],
        ["export", "--model", str(out), "--out", str(tmp_path / "x")],
        hf_home=hf_home,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == REPO and adapter["revision"] == COMMIT
    metas = sorted(out.glob("checkpoints/*/meta.json"))
    assert metas and json.loads(metas[-1].read_text())["run"]["model_revision"] == COMMIT
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "x" / "config.json").is_file()


def test_validate_plan_and_chat_take_a_hub_id(hf_home, tmp_path, data_file):
    cfg = _config(tmp_path, data_file, REPO)
    validated, planned, chat = keel_offline_commands(
        ["validate", str(cfg)],
        ["plan", str(cfg)],
        ["chat", "--model", REPO, "--prompt", "hi", "--max-new-tokens", "2"],
        hf_home=hf_home,
    )
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert chat.returncode == 0, chat.stderr[-3000:]


def test_missing_id_and_unknown_revision_exit_2(hf_home, tmp_path, data_file):
    absent = _config(tmp_path, data_file, "tiny-org/absent", name="absent.yaml")
    cfg = _config(tmp_path, data_file, REPO)
    missing, unknown, pinned = keel_offline_commands(
        ["train", str(absent)],
        ["validate", str(cfg), "model.revision=v9"],
        ["validate", str(cfg), f"model.revision={COMMIT}"],
        hf_home=hf_home,
    )
    assert missing.returncode == 2, missing.stderr[-3000:]
    assert "Traceback" not in missing.stderr
    assert "tiny-org/absent (revision main) is not a local folder and is not in" in missing.stderr
    assert not (tmp_path / "out" / "config.yaml").exists()
    assert unknown.returncode == 2 and "(revision v9) is not a local folder" in unknown.stderr
    assert pinned.returncode == 0, pinned.stderr[-3000:]
