"""The `preference:` section: validated up front, and part of what a resumed run must match."""

import json

import pytest

from keel.config import load_config
from keel.errors import CheckpointError, ConfigError
from keel.train.run import run_training

PAIRS = [
    {"prompt": f"Question {i}?", "chosen": f"Sure! Answer {i}.", "rejected": "No."}
    for i in range(6)
]


def config(tmp_path, model_dir, **preference) -> dict:
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
        "preference": preference,
        "output": {"dir": str(tmp_path / "run"), "save_every": 2},
    }


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["preference.beta=0"], "preference.beta = 0"),
        (["preference.label_smoothing=0.5"], "preference.label_smoothing = 0.5 must be in"),
        (["preference.loss_type=ipo", "preference.label_smoothing=0.1"], "the ipo loss"),
        (["train.stage=orpo", "preference.loss_type=hinge"], "applies to train.stage dpo only"),
        (["train.stage=simpo", "preference.reference=precompute"], "simpo uses no reference"),
        (["train.stage=orpo", "preference.reference=live"], "orpo uses no reference"),
        (["preference.gamma=1.0"], "preference.gamma applies to train.stage simpo only"),
        (["preference.desirable_weight=2"], "apply to train.stage kto only"),
        (["train.stage=kto", "preference.undesirable_weight=0"], "undesirable_weight = 0"),
        (["train.stage=sft", "preference.beta=0.5"], "preference is set but train.stage = sft"),
    ],
)
def test_bad_preference_settings_are_refused_up_front(tmp_path, tiny_model_dir, overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, base=config(tmp_path, tiny_model_dir))
    assert needle in "\n".join(info.value.problems)


def test_good_preference_settings_pass(tmp_path, tiny_model_dir):
    for overrides in (
        ["preference.loss_type=robust", "preference.label_smoothing=0.1"],
        ["train.stage=simpo", "preference.gamma=1.0", "preference.beta=2"],
        ["train.stage=kto", "preference.reference=precompute", "preference.desirable_weight=1.3"],
    ):
        load_config(None, overrides, base=config(tmp_path, tiny_model_dir))


def test_resume_refuses_another_beta(tmp_path, tiny_model_dir):
    base = config(tmp_path, tiny_model_dir)
    run_training(load_config(None, [], base=base), log=lambda _m: None)
    with pytest.raises(CheckpointError) as info:
        run_training(
            load_config(None, ["train.max_steps=4", "preference.beta=0.2"], base=base),
            log=lambda _m: None,
        )
    assert "preference.beta was 0.1 in the checkpoint, this run has 0.2" in str(info.value)
    resumed = run_training(load_config(None, ["train.max_steps=4"], base=base), log=lambda _m: None)
    assert len(resumed.losses) == 2  # the same settings continue
