"""A truncated or damaged safetensors file is refused by name (exit 2), never read as zeros.

Before: a model.safetensors cut short kept its whole header, the positioned-read loader
ignored the short reads, and `keel train` trained on zeros and exited 0; `keel chat` and
`keel export` ended in a traceback from the safetensors reader.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from keel.cli import main
from keel.errors import ModelError
from keel.models.materialize import CheckpointReader

ROOT = Path(__file__).resolve().parents[2]
CUT = 100  # bytes taken off the end: less than one tensor of the tiny model


def truncated_copy(tiny_model_dir: Path, tmp_path: Path, name="model.safetensors") -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / name
    os.truncate(weights, weights.stat().st_size - CUT)
    return folder


def train_args(model: Path, tmp_path: Path, command: str = "train") -> list[str]:
    return [
        command,
        str(ROOT / "examples" / "identity_lora.yaml"),
        f"model.path={model}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"data.datasets.0.path={ROOT / 'examples' / 'data' / 'identity.json'}",
        f"output.dir={tmp_path / 'out'}",
        "train.max_steps=1",
        "train.precision=fp32",
        "train.threads=1",
    ]


def assert_named(stderr: str, folder: Path) -> None:
    assert "Traceback" not in stderr
    assert f"{folder / 'model.safetensors'} is truncated" in stderr, stderr
    assert "tensors lie past the end, the first tensor model." in stderr, stderr


@pytest.mark.parametrize("command", ["validate", "train"])
def test_train_and_validate_refuse_a_truncated_model_before_training(
    command, tiny_model_dir, tmp_path, capsys
):
    folder = truncated_copy(tiny_model_dir, tmp_path)
    assert main(train_args(folder, tmp_path, command)) == 2
    assert_named(capsys.readouterr().err, folder)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_chat_and_export_refuse_a_truncated_model(tiny_model_dir, tmp_path, capsys):
    folder = truncated_copy(tiny_model_dir, tmp_path)
    chat = ["chat", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]
    assert main([*chat, "--cache-dir", str(tmp_path / "cache")]) == 2
    assert_named(capsys.readouterr().err, folder)
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "exported")]) == 2
    assert_named(capsys.readouterr().err, folder)
    assert not (tmp_path / "exported" / "model.safetensors").exists()


def test_a_read_that_comes_back_short_raises_instead_of_leaving_zeros(tiny_model_dir, tmp_path):
    """The file shrinks after the check (another process, a full disk): the read itself
    must notice, not hand back a zero-filled tensor."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    reader = CheckpointReader(folder)
    try:
        last = max(reader.keys(), key=lambda key: reader._where[key][2]["data_offsets"][1])
        weights = folder / "model.safetensors"
        os.truncate(weights, weights.stat().st_size - CUT)
        with pytest.raises(ModelError, match=f"reading tensor {last} ended after"):
            reader.get(last)
    finally:
        reader.close()


@pytest.fixture
def sharded_dir(tmp_path) -> Path:
    """The tiny model saved in several shards with a model.safetensors.index.json."""
    folder = tmp_path / "sharded"
    torch.manual_seed(0)
    build_tiny_model(320).save_pretrained(folder, max_shard_size="40KB")
    build_tiny_tokenizer().save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_a_truncated_or_missing_shard_is_named(sharded_dir):
    from keel.models.safetensors_files import check_model_dir

    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    assert len(shards) >= 2 and len(check_model_dir(sharded_dir)) == len(shards)
    os.truncate(shards[1], shards[1].stat().st_size - CUT)
    with pytest.raises(ModelError, match=f"{shards[1]} is truncated"):
        CheckpointReader(sharded_dir)
    shards[1].unlink()
    with pytest.raises(ModelError, match=f"names 1 file.* \\(e.g. {shards[1].name}\\)"):
        check_model_dir(sharded_dir)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[:6], "too short to be safetensors"),
        (lambda data: data[:40], "its header says"),
        (lambda data: data[:8] + b"{" * (len(data) - 8), "header is not valid JSON"),
    ],
)
def test_a_damaged_header_is_named(tiny_model_dir, tmp_path, damage, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ModelError, match=message):
        CheckpointReader(folder)
