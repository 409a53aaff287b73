"""The stages' own config sections (dpo:, orpo:, simpo:, kto:): validated up front, a key in
the wrong section is an unknown key, and part of what a resumed run must match."""

import dataclasses
import json
import shutil

import pytest

from keel.config import config_to_dict, load_config
from keel.config.schema import RunConfig
from keel.config.validate import check_config
from keel.errors import CheckpointError, ConfigError
from keel.stages.registry import STAGES, stage_sections
from keel.train.run import run_training

PAIRS = [
    {"prompt": f"Question {i}?", "chosen": f"Sure! Answer {i}.", "rejected": "No."}
    for i in range(6)
]
# The flat `preference:` section of keels before per-stage sections, with its defaults: what
# their checkpoints recorded in meta.json, whatever the stage.
OLD_PREFERENCE = {
    "beta": 0.1,
    "loss_type": "sigmoid",
    "label_smoothing": 0.0,
    "gamma": 0.5,
    "reference": "auto",
    "desirable_weight": 1.0,
    "undesirable_weight": 1.0,
}


def config(tmp_path, model_dir, **dpo) -> dict:
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(PAIRS))
    return {
        "model": {"path": str(model_dir), "cache_dir": str(tmp_path / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "train": {
            "stage": "dpo",
            "max_steps": 2,
            "micro_batch_size": 2,
            "precision": "fp32",
            "threads": 1,
            "scheduler": "constant",
        },
        "dpo": dpo,
        "output": {"dir": str(tmp_path / "run"), "save_every": 2},
    }


def problems(tmp_path, model_dir, overrides, base=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, base=base or config(tmp_path, model_dir))
    return "\n".join(info.value.problems)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["dpo.beta=0"], "dpo.beta = 0.0 must be > 0"),
        (["dpo.label_smoothing=0.5"], "dpo.label_smoothing = 0.5 must be in"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "the ipo loss"),
        (["train.stage=simpo", "simpo.label_smoothing=-0.1"], "simpo.label_smoothing = -0.1"),
        (["train.stage=orpo", "orpo.beta=-1"], "orpo.beta = -1.0 must be > 0"),
        (["train.stage=kto", "kto.undesirable_weight=0"], "kto.undesirable_weight = 0.0"),
        (["dpo.loss_type=sigmod"], "did you mean 'sigmoid'?"),
    ],
)
def test_bad_stage_settings_are_refused_up_front(tmp_path, tiny_model_dir, overrides, needle):
    assert needle in problems(tmp_path, tiny_model_dir, overrides)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["dpo.desirable_weight=2"], "unknown key dpo.desirable_weight (command line); "),
        (["dpo.desirable_weight=2"], "did you mean 'kto.desirable_weight'?"),
        (["train.stage=kto", "kto.gamma=1"], "unknown key kto.gamma (command line); did you"),
        (["train.stage=kto", "kto.gamma=1"], "(kto has beta, reference, desirable_weight,"),
        (
            ["train.stage=orpo", "orpo.reference=live"],
            "'dpo.reference', 'kto.reference' or 'grpo.reference'?",
        ),
        (["dpo.betta=0.2"], "did you mean 'dpo.beta'?"),
        (["dop.beta=0.2"], "unknown key dop (command line); did you mean 'dpo'?"),
    ],
)
def test_a_key_in_the_wrong_section_is_an_unknown_key(tmp_path, tiny_model_dir, overrides, needle):
    assert needle in problems(tmp_path, tiny_model_dir, overrides)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["kto.beta=0.5"], "kto is set but train.stage = dpo"),
        (["kto.beta=0.5"], "set train.stage = kto, or write dpo: instead"),
        (["train.stage=sft", "dpo.beta=0.5"], "dpo is set but train.stage = sft"),
        (["train.stage=sft", "dpo.beta=0.5"], "set train.stage = dpo, or remove dpo"),
    ],
)
def test_a_section_of_another_stage_is_refused(tmp_path, tiny_model_dir, overrides, needle):
    assert needle in problems(tmp_path, tiny_model_dir, overrides)


def test_the_old_preference_section_is_refused_with_the_section_to_write(tmp_path, tiny_model_dir):
    base = config(tmp_path, tiny_model_dir)
    del base["dpo"]
    base["preference"] = {"beta": 0.2, "loss_type": "ipo"}
    assert problems(tmp_path, tiny_model_dir, [], base) == (
        "preference was split into per-stage sections: for train.stage dpo write "
        "dpo: {beta: 0.2, loss_type: ipo} instead"
    )
    got = problems(tmp_path, tiny_model_dir, ["train.stage=simpo", "preference.gamma=1"], base)
    assert got.endswith("write simpo: {beta: 0.2, gamma: 1} instead; simpo has no loss_type")
    got = problems(tmp_path, tiny_model_dir, ["train.stage=sft"], base)
    assert "train.stage sft has none: remove preference" in got


def test_good_stage_settings_pass_and_overrides_apply(tmp_path, tiny_model_dir):
    base = config(tmp_path, tiny_model_dir, beta=0.3)
    cfg = load_config(None, ["dpo.beta=0.2", "dpo.loss_type=robust"], base=base)
    assert (cfg.stage_settings.beta, cfg.stage_settings.loss_type) == (0.2, "robust")
    assert cfg.stage_settings is cfg.dpo
    for overrides in (
        ["dpo.loss_type=robust", "dpo.label_smoothing=0.1"],
        ["train.stage=simpo", "dpo=null", "simpo.gamma=1.0", "simpo.beta=2"],
        ["train.stage=kto", "dpo=null", "kto.reference=precompute", "kto.desirable_weight=1.3"],
    ):
        load_config(None, overrides, base=base)


def test_an_unset_section_reads_the_stage_defaults(tmp_path, tiny_model_dir):
    base = config(tmp_path, tiny_model_dir)
    del base["dpo"]
    cfg = load_config(None, [], base=base)
    assert cfg.dpo is None and cfg.stage_settings == STAGES["dpo"].settings()
    written = config_to_dict(cfg)  # the resolved config: the stage's section, nothing else
    assert written["dpo"] == dataclasses.asdict(STAGES["dpo"].settings())
    assert not set(stage_sections()) - {"dpo"} & set(written)
    assert list(written).index("dpo") == list(written).index("train") + 1
    assert load_config(None, [], base=written).stage_settings == cfg.stage_settings
    sft = load_config(None, ["train.stage=sft"], base=base)
    assert sft.stage_settings is None and not set(stage_sections()) & set(config_to_dict(sft))


def test_the_sections_and_their_checks_come_from_the_registry(monkeypatch, tmp_path):
    """RunConfig has one optional section per stage with settings; validation asks the
    run's stage record for its settings and their checks (no list of knobs in keel.config)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    assert set(stage_sections()) <= fields
    assert {name for name, s in STAGES.items() if s.settings} == set(stage_sections())

    @dataclasses.dataclass(kw_only=True)
    class FakeSettings:
        depth: int = 3

        def problems(self, section: str) -> list[str]:
            return [f"{section}.depth = {self.depth}: checked by the stage"]

    fake = dataclasses.replace(STAGES["orpo"], name="fake", settings=FakeSettings)
    monkeypatch.setitem(STAGES, "fake", fake)
    cfg = load_config(None, ["train.stage=orpo"], base=_valid(tmp_path))
    cfg.train.stage = "fake"
    assert cfg.stage_settings == FakeSettings() and fake.knobs == ("depth",)
    assert "fake.depth = 3: checked by the stage" in check_config(cfg)


def _valid(tmp_path) -> dict:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "d.json").write_text(json.dumps(PAIRS))
    return {
        "model": {"path": str(tmp_path / "model")},
        "data": {"datasets": [str(tmp_path / "d.json")]},
        "output": {"dir": str(tmp_path / "run")},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A finished 2-step DPO run with a checkpoint at step 2 (tests copy it)."""
    root = tmp_path_factory.mktemp("dpo")
    base = config(root, tiny_model_dir)
    run_training(load_config(None, [], base=base), log=lambda _m: None)
    return root, base


def copy_run(trained, tmp_path) -> dict:
    root, base = trained
    shutil.copytree(root / "run", tmp_path / "run")
    return {**base, "output": {**base["output"], "dir": str(tmp_path / "run")}}


def resume(base: dict, *overrides: str):
    cfg = load_config(None, ["train.max_steps=4", *overrides], base=base)
    return run_training(cfg, log=lambda _m: None)


def test_resume_refuses_another_beta(trained, tmp_path):
    base = copy_run(trained, tmp_path)
    with pytest.raises(CheckpointError) as info:
        resume(base, "dpo.beta=0.2")
    assert "dpo.beta was 0.1 in the checkpoint, this run has 0.2" in str(info.value)
    assert len(resume(base).losses) == 2  # the same settings continue


def as_written_before_stage_sections(run_dir) -> None:
    """Rewrite every checkpoint's meta.json in the layout of keels with one flat
    `preference:` section: the run identity's `preference` and the config's section."""
    for meta_path in run_dir.glob("checkpoints/*/meta.json"):
        meta = json.loads(meta_path.read_text())
        assert meta["run"].pop("stage_settings") == {
            k: v for k, v in OLD_PREFERENCE.items() if k in STAGES["dpo"].knobs
        }
        meta["run"]["preference"] = OLD_PREFERENCE
        meta["config"] = {
            ("preference" if key == "dpo" else key): (OLD_PREFERENCE if key == "dpo" else value)
            for key, value in meta["config"].items()
        }
        meta_path.write_text(json.dumps(meta))


def test_a_checkpoint_of_the_flat_preference_layout_resumes(trained, tmp_path):
    base = copy_run(trained, tmp_path)
    as_written_before_stage_sections(tmp_path / "run")
    with pytest.raises(CheckpointError) as info:
        resume(base, "dpo.beta=0.2")  # a changed knob is named by its new key
    assert "dpo.beta was 0.1 in the checkpoint, this run has 0.2" in str(info.value)
    assert "preference" not in str(info.value)
    assert len(resume(base).losses) == 2  # the same settings continue
