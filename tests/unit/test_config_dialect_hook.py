"""A LLaMA-Factory or Axolotl YAML through keel's loader and `keel convert`: translated before
overrides, refusals as config problems naming their key, the report handed to the caller,
and a converted file that loads to the same config."""

from __future__ import annotations

import pytest
import yaml

from keel.cli import main
from keel.config import load_config
from keel.errors import ConfigError

THEIRS = """\
model_name_or_path: some/model
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
dataset: alpaca_mini
dataset_dir: examples/data/llamafactory
template: qwen
cutoff_len: 256
output_dir: {out}
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: {lr}
num_train_epochs: 1.0
"""


def _write(tmp_path, text: str, name: str = "theirs.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _theirs(tmp_path, lr="1.0e-4", extra: str = ""):
    return _write(tmp_path, THEIRS.format(out=tmp_path / "out", lr=lr) + extra)


def test_a_dialect_config_is_translated_and_its_translation_handed_over(tmp_path):
    seen = []
    cfg = load_config(_theirs(tmp_path), on_translation=seen.append)
    assert [t.dialect for t in seen] == ["llamafactory"]
    assert cfg.method.type == "lora" and cfg.method.lora.r == 8
    assert cfg.train.lr == pytest.approx(1e-4) and cfg.train.grad_accum == 2
    assert cfg.data.dataset_dir == "examples/data/llamafactory"
    assert "lora_rank" in seen[0].report()


def test_a_keel_config_is_not_translated(tmp_path):
    path = _write(
        tmp_path,
        "model: {path: some/model}\ndata: {datasets: [x.json]}\noutput: {dir: out}\n",
    )
    seen = []
    load_config(path, on_translation=seen.append)
    assert seen == []


def test_overrides_name_keel_keys_and_apply_after_the_translation(tmp_path):
    cfg = load_config(_theirs(tmp_path), ["train.lr=3e-4", "method.lora.r=4"])
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.method.lora.r == 4


def test_a_refused_key_is_a_problem_naming_it_and_where(tmp_path):
    path = _theirs(tmp_path, extra="no_such_llamafactory_key: 1\n")
    seen = []
    with pytest.raises(ConfigError) as caught:
        load_config(path, on_translation=seen.append)
    (problem,) = [p for p in caught.value.problems if "no_such_llamafactory_key" in p]
    assert f"{path}:15" in problem
    assert seen and seen[0].refused(), "the report is shown before the refusal"


def test_a_bad_value_is_located_at_their_key(tmp_path):
    path = _theirs(tmp_path, lr="fast")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert "train.lr" in problem and "learning_rate" in problem and f"{path}:13" in problem


def test_convert_writes_a_keel_config_that_loads_the_same(tmp_path, capsys):
    theirs, out = _theirs(tmp_path), tmp_path / "keel.yaml"
    assert main(["convert", str(theirs), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# ") and "LLaMA-Factory" in text and "lora_rank" in text
    body = yaml.safe_load(text)
    assert {"model", "method", "data", "train", "output"} <= set(body)
    assert load_config(out) == load_config(theirs)
    assert "LLaMA-Factory" in capsys.readouterr().out


def test_convert_never_overwrites_a_file(tmp_path, capsys):
    out = _write(tmp_path, "mine\n", "keel.yaml")
    assert main(["convert", str(_theirs(tmp_path)), "--out", str(out)]) == 2
    assert out.read_text() == "mine\n"
    assert "never overwrites" in capsys.readouterr().err


def test_convert_refuses_a_keel_config_and_refused_keys(tmp_path, capsys):
    keel_cfg = _write(
        tmp_path, "model: {path: some/model}\ndata: {datasets: [x.json]}\noutput: {dir: o}\n"
    )
    out = tmp_path / "keel.yaml"
    assert main(["convert", str(keel_cfg), "--out", str(out)]) == 2
    assert "nothing to convert" in capsys.readouterr().err
    refused = _theirs(tmp_path, extra="no_such_llamafactory_key: 1\n")
    assert main(["convert", str(refused), "--out", str(out)]) == 2
    shown = capsys.readouterr()
    assert "no_such_llamafactory_key" in shown.err
    assert "refused (1):" in shown.out, "the mapping report comes first"
    assert not out.exists()


def test_a_refused_key_in_the_deepspeed_json_is_located_at_the_line_naming_it(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}, "made_up": 1}')
    path = _theirs(tmp_path, extra=f"deepspeed: {tmp_path / 'ds.json'}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"deepspeed.made_up ({path}:15) is refused: ")


def test_a_refused_key_their_file_leaves_out_names_the_file(tmp_path):
    path = _write(tmp_path, THEIRS.format(out=tmp_path, lr=1e-4).replace("do_train: true\n", ""))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"do_train ({path}) is refused: left out, so false")
