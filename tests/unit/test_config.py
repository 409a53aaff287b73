"""Config loading: YAML, overrides, and every problem reported at once with a fix."""

from pathlib import Path

import pytest
import yaml

from keel.config import load_config
from keel.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path, data) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


def minimal(tmp_path, **sections):
    cfg = {
        "model": {"path": "bundled:smollm2-135m-instruct"},
        "data": {"datasets": ["d.json"]},
        "output": {"dir": str(tmp_path / "out")},
    }
    cfg.update(sections)
    return cfg


def test_minimal_config_gets_defaults(tmp_path):
    cfg = load_config(write(tmp_path, minimal(tmp_path)))
    assert cfg.method.type == "lora" and cfg.method.lora.targets == "all-linear"
    assert cfg.data.datasets[0].path == "d.json" and cfg.data.datasets[0].format == "auto"
    assert cfg.train.precision == "auto" and cfg.train.lr == 2e-4


def test_overrides_set_nested_and_list_values(tmp_path):
    cfg = load_config(
        write(tmp_path, minimal(tmp_path)),
        [
            "train.lr=1e-4",
            "data.packing=true",
            "data.datasets.0.format=alpaca",
            "method.lora.targets=[q_proj, v_proj]",
            "train.max_steps=7",
        ],
    )
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.data.packing is True
    assert cfg.data.datasets[0].format == "alpaca"
    assert cfg.method.lora.targets == ["q_proj", "v_proj"]
    assert cfg.train.max_steps == 7


def test_all_problems_reported_at_once_with_lines_and_suggestions(tmp_path):
    text = """model:
  path: bundled:smollm2-135m-instruct
  dtyp: float32
method:
  type: lorra
data:
  datasets: [d.json]
  cutof_len: 512
train:
  micro_batch_size: two
output:
  dir: out
"""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), ["train.seed=abc"])
    problems = info.value.problems
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    assert (
        "model.dtyp" in joined and "did you mean 'model.dtype'" in joined and "run.yaml:3" in joined
    )
    assert "data.cutof_len" in joined and "did you mean 'data.cutoff_len'" in joined
    assert "'lorra' is not one of full, freeze, lora, qlora, oft; did you mean 'lora'" in joined
    assert "train.micro_batch_size (" in joined and "must be an integer" in joined
    assert "train.seed (command line)" in joined


def test_missing_required_sections_are_named_with_the_fix(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, {"train": {"lr": 0.1}}))
    joined = "\n".join(info.value.problems)
    for key in ("'model'", "'data'", "'output'"):
        assert key in joined


def test_cross_field_rules(tmp_path):
    data = minimal(
        tmp_path,
        train={"lr": -1, "micro_batch_size": 0, "warmup_ratio": 1.5, "stage": "sft"},
        output={"dir": "o", "merge_lora": True, "log_every": 0},
    )
    data["method"] = {"type": "full"}
    data["data"]["datasets"] = [{"path": "t.txt", "format": "text"}]
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data))
    joined = "\n".join(info.value.problems)
    for needle in (
        "train.lr = -1",
        "train.micro_batch_size = 0",
        "train.warmup_ratio",
        "output.merge_lora",
        "output.log_every",
        "format = text",
    ):
        assert needle in joined, needle


def test_bad_yaml_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [unclosed"))
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(write(tmp_path, minimal(tmp_path)), ["train.lr"])
    with pytest.raises(ConfigError, match="unknown key train.lrr"):
        load_config(write(tmp_path, minimal(tmp_path)), ["train.lrr=1"])


def test_missing_model_dir_is_reported(tmp_path):
    data = minimal(tmp_path)
    data["model"]["path"] = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="model.path .* does not exist"):
        load_config(write(tmp_path, data))


# Examples whose model.path a demo script builds first (benchmarks/vision_demo.py assembles
# it): parsed with the bundled model in its place
BUILT_BY_A_DEMO = {"vision_llava_demo.yaml"}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_example_parses(path, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)
    built = path.name in BUILT_BY_A_DEMO
    cfg = load_config(path, ["model.path=bundled:smollm2-135m-instruct"] if built else [])
    assert cfg.output.dir


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys silently (lr: 5.0 won); keel refuses, at any
    depth, naming both lines."""
    text = """model:
  path: bundled:smollm2-135m-instruct
data:
  datasets:
    - path: a.json
      format: alpaca
      format: sharegpt
output:
  dir: out
train:
  lr: 1.0e-4
  seed: 1
  lr: 5.0
"""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    joined = "\n".join(info.value.problems)
    path = tmp_path / "run.yaml"
    assert f"train.lr is set twice, at {path}:11 and {path}:13" in joined
    assert "(5.0)" in joined
    assert f"data.datasets.0.format is set twice, at {path}:6 and {path}:7" in joined
    assert len(info.value.problems) == 2, joined


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    text = """model: {path: bundled:smollm2-135m-instruct}
data: {datasets: [d.json]}
output: {dir: out}
train:
  <<: {lr: 1.0e-4, seed: 3}
  lr: 2.0e-4
"""
    cfg = load_config(write(tmp_path, text))
    assert cfg.train.lr == pytest.approx(2e-4) and cfg.train.seed == 3


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=inf",
        "train.lr=nan",
        "train.lr=.inf",
        "train.lr=-.inf",
        "train.lr=1e999",
        "train.weight_decay=.nan",
        "train.max_grad_norm=inf",
        "train.adam_betas=[0.9, .nan]",
        "dpo.beta=inf",
        "watchdog.stall_timeout_s=inf",
        "data.val_size=nan",
    ],
)
def test_non_finite_numbers_are_refused_on_the_command_line(tmp_path, override):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, minimal(tmp_path)), [override])
    key = override.split("=")[0]
    joined = "\n".join(info.value.problems)
    assert f"{key}" in joined and "must be a finite number" in joined, joined


def test_non_finite_numbers_are_refused_in_yaml_with_their_line(tmp_path):
    text = """model: {path: bundled:smollm2-135m-instruct}
data: {datasets: [d.json]}
output: {dir: out}
train:
  lr: .inf
  weight_decay: .NaN
"""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    joined = "\n".join(info.value.problems)
    assert "train.lr (" in joined and "run.yaml:5) = inf must be a finite number" in joined
    assert (
        "train.weight_decay (" in joined and "run.yaml:6) = nan must be a finite number" in joined
    )


def test_check_config_refuses_non_finite_numbers_of_a_config_built_in_code(tmp_path):
    from keel.config.validate import check_config

    cfg = load_config(write(tmp_path, minimal(tmp_path)))
    cfg.train.lr = float("inf")
    cfg.train.adam_betas = [0.9, float("nan")]
    problems = check_config(cfg)
    assert "train.lr = inf must be a finite number" in problems
    assert "train.adam_betas.1 = nan must be a finite number" in problems


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["data.min_len=-1"], "must be a whole number of tokens >= 0"),
        (["data.min_len=2000", "data.cutoff_len=1024"], "is over data.cutoff_len = 1024"),
        (["data.min_len=16", "train.stage=dpo"], "train.stage dpo's pairs are not filtered"),
        (["data.min_len=16", "train.stage=pt"], None),
    ],
)
def test_min_len_is_a_length_pt_and_sft_samples_can_have(tmp_path, overrides, problem):
    path = write(tmp_path, minimal(tmp_path))
    if problem is None:
        assert load_config(path, overrides).data.min_len == 16
        return
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_overlength_split_is_for_pretraining_only(tmp_path):
    path = write(tmp_path, minimal(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_config(path, ["data.overlength=split"])  # sft
    (problem,) = info.value.problems
    assert "train.stage pt" in problem and "drop, truncate or error" in problem
    cfg = load_config(path, ["data.overlength=split", "train.stage=pt"])
    assert cfg.data.overlength == "split"
