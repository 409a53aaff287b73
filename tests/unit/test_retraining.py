"""Retraining is never a silent no-op: a finished run is replaced, extended or refused; a
changed config names its keys; an extension follows the schedule of its new length."""

import json
import shutil

import pytest
import yaml
from config_support import qa_rows, tiny_lora_config

from keel.checkpoint.identity import config_differences
from keel.config import load_config
from keel.errors import CheckpointError
from keel.train.optim import lr_factor
from keel.train.resume import _finished_step
from keel.train.run import run_training

ROWS = qa_rows(8)
LR = 1e-2


class Crash(Exception):
    pass


def base_config(model_dir, data, out) -> dict:
    return tiny_lora_config(model_dir, data, out, train={"max_steps": 4, "scheduler": "cosine"})


def crash_after_2(step, _record):
    if step == 2:
        raise Crash()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """A finished 4-step cosine run, and the same run stopped after its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("retrain")
    data = root / "qa.json"
    data.write_text(json.dumps(ROWS))
    base = base_config(tiny_model_dir, data, root / "finished")
    run_training(load_config(None, [], base=base), log=lambda _m: None)
    stopped = {**base, "output": {**base["output"], "dir": str(root / "stopped")}}
    with pytest.raises(Crash):
        run_training(
            load_config(None, [], base=stopped), log=lambda _m: None, on_step_end=crash_after_2
        )
    return root, base


def copy_of(runs, tmp_path, name: str):
    root, base = runs
    out = tmp_path / name
    shutil.copytree(root / name, out)
    return out, {**base, "output": {**base["output"], "dir": str(out)}}


def train(base: dict, *overrides: str):
    lines: list[str] = []
    result = run_training(load_config(None, list(overrides), base=base), log=lines.append)
    return result, lines


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def step_records(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r]


def test_overwrite_replaces_a_finished_run(runs, tmp_path):
    """The README's `keel train examples/identity_lora.yaml train.lr=5e-4` after `make demo`
    (overwrite: true) "resumed" the finished run at its last step and trained nothing."""
    out, base = copy_of(runs, tmp_path, "finished")
    result, lines = train(base, "output.overwrite=true", "train.lr=5e-3")
    assert len(result.losses) == 4 and result.summary["real_tokens"] > 0
    assert any(
        f"the run in {out} finished at step 4; replacing it with a new run from step 0" in line
        for line in lines
    ), lines
    assert f"output.overwrite: removing {out / 'checkpoints'}" in lines
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 5e-3
    assert [r["step"] for r in step_records(out)] == [1, 2, 3, 4]  # not appended to
    assert step_records(out)[0]["lr"] == pytest.approx(5e-3)


@pytest.mark.parametrize("overrides", [(), ("train.lr=5e-3",)], ids=["same", "new-lr"])
def test_without_overwrite_a_finished_run_is_refused(runs, tmp_path, overrides):
    out, base = copy_of(runs, tmp_path, "finished")
    before = listing(out)
    with pytest.raises(CheckpointError) as info:
        train(base, *overrides)
    message = str(info.value)
    assert f"output.dir {out} holds a run that finished at step 4" in message, message
    assert "set output.overwrite=true" in message and "raise train.max_steps" in message
    assert listing(out) == before


def test_an_extension_runs_on_the_schedule_of_its_new_length(runs, tmp_path):
    """Extending a finished cosine run ran its next step at lr 0.0 (the old schedule's end)
    and the one after on the new schedule, silently."""
    out, base = copy_of(runs, tmp_path, "finished")
    result, lines = train(base, "train.max_steps=6")
    assert len(result.losses) == 2
    lrs = {r["step"]: r["lr"] for r in step_records(out)}
    for step in (5, 6):  # as an uninterrupted 6-step run has them
        want = LR * lr_factor(step - 1, total_steps=6, warmup=0, kind="cosine")
        assert lrs[step] == pytest.approx(want, rel=1e-6), (step, lrs)
    assert lrs[5] == pytest.approx(LR / 4)  # cos(2 pi / 3): a quarter of the peak
    assert f"resume: extending the run in {out}, which finished at step 4, to 6 steps" in lines
    assert (
        "lr schedule: cosine over this run's 6 steps; step 5 runs at lr 0.0025 where the "
        "checkpoint's, from its 4-step schedule, was 0 "
    ) in "\n".join(lines)


@pytest.mark.parametrize(
    "override,named",
    [
        ("data.packing=true", "data.packing was False in the checkpoint, this run has True"),
        ("train.lr=5e-3", "train.lr was 0.01 in the checkpoint, this run has 0.005"),
        ("train.scheduler=linear", "train.scheduler was 'cosine' in the checkpoint"),
    ],
    ids=["packing", "lr", "scheduler"],
)
def test_an_interrupted_run_with_another_setting_is_refused_naming_it(
    runs, tmp_path, override, named
):
    out, base = copy_of(runs, tmp_path, "stopped")
    before = listing(out)
    with pytest.raises(CheckpointError) as info:
        train(base, override)
    message = str(info.value)
    assert named in message, message
    assert "fingerprint" not in message  # the key, not the data fingerprint it changed
    assert "train.resume=never and output.overwrite=true" in message
    assert listing(out) == before


def test_an_interrupted_run_resumes_with_settings_that_may_change(runs, tmp_path):
    out, base = copy_of(runs, tmp_path, "stopped")
    result, lines = train(base, "output.log_every=2", "train.threads=2", "train.max_steps=5")
    assert len(result.losses) == 3  # steps 3, 4 and 5
    assert any(line.startswith("lr schedule: cosine over this run's 5 steps") for line in lines)


def test_config_differences_names_keys_and_ignores_resumable_ones():
    saved = {
        "train": {"lr": 2e-4, "max_steps": 12, "adam_betas": [0.9, 0.999]},
        "output": {"log_every": 1, "dir": "a"},
        "data": {"datasets": [{"path": "a.json"}], "packing": True},
        "method": {"lora": {"r": 16}},  # compared through the run identity
        "watchdog": {"hang_timeout_s": 120.0},
    }
    now = {
        "train": {"lr": 5e-4, "max_steps": 16, "adam_betas": (0.9, 0.999), "new_key": 1},
        "output": {"log_every": 5, "dir": "b"},
        "data": {"datasets": [{"path": "b.json"}], "packing": False},
        "method": {"lora": {"r": 8}},
        "watchdog": {"hang_timeout_s": 60.0},
    }
    assert config_differences(saved, now) == [
        (
            "data.datasets[0].path",
            "data.datasets[0].path was 'a.json' in the checkpoint, this run has 'b.json'",
        ),
        ("data.packing", "data.packing was True in the checkpoint, this run has False"),
        ("train.lr", "train.lr was 0.0002 in the checkpoint, this run has 0.0005"),
    ]


def test_a_run_is_finished_only_at_its_summarys_step(tmp_path):
    """An extension that stopped before its new end (keel_run.json still says the old one)
    is an interrupted run, resumed as any other."""
    newest = tmp_path / "checkpoints" / "step-00000014"
    assert _finished_step(tmp_path, newest) is None  # no keel_run.json
    (tmp_path / "keel_run.json").write_text(json.dumps({"steps": 12}))
    assert _finished_step(tmp_path, newest) is None
    assert _finished_step(tmp_path, tmp_path / "checkpoints" / "step-00000012") == 12
