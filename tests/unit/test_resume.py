"""Resume continues only the same run, and loading a checkpoint unpickles nothing."""

import json
import math
import pickle
import shutil

import pytest
import yaml
from cli_support import keel_in_process
from config_support import qa_rows, tiny_lora_config

import keel.checkpoint.dcp as dcp
from keel.checkpoint import layout
from keel.checkpoint.rng import load_rng, restore_rng, save_rng
from keel.config import load_config
from keel.errors import CheckpointError
from keel.train.batch_source import StepPlan, default_global_batch
from keel.train.run import run_training

ROWS = qa_rows(8)


def base_config(model_dir, data, out) -> dict:
    return tiny_lora_config(model_dir, data, out, train={"scheduler": "constant"})


def quiet(_msg):
    pass


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A finished 2-step run with a checkpoint at step 2 (shared: tests copy it)."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "qa.json"
    data.write_text(json.dumps(ROWS))
    base = base_config(tiny_model_dir, data, root / "run")
    run_training(load_config(None, [], base=base), log=quiet)
    return root, base


def copy_run(finished, tmp_path):
    root, base = finished
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)
    return out, {**base, "output": {**base["output"], "dir": str(out)}}


def resume(base: dict, *overrides: str):
    """Train 4 steps from the step-2 checkpoint with `overrides` changed."""
    return run_training(load_config(None, ["train.max_steps=4", *overrides], base=base), log=quiet)


def test_the_same_run_resumes(finished, tmp_path):
    _, base = copy_run(finished, tmp_path)
    assert len(resume(base).losses) == 2  # steps 3 and 4


@pytest.mark.parametrize(
    "override,key,old,new",
    [
        ("method.type=full", "method.type", "'lora'", "'full'"),
        ("method.lora.r=8", "method.lora.r", "4", "8"),
        ("method.lora.targets=[q_proj]", "method.lora.targets", "'all-linear'", "['q_proj']"),
        ("train.stage=pt", "train.stage", "'sft'", "'pt'"),
        ("train.precision=bf16", "train.precision", "'fp32'", "'bf16'"),
        ("train.global_batch_size=3", "train.global_batch_size", "2", "3"),
        ("data.cutoff_len=60", "data.cutoff_len", "64", "60"),  # the key, not the fingerprint
        ("train.optimizer=adamw_8bit", "train.optimizer", "'adamw'", "'adamw_8bit'"),
        ("method.type=qlora", "method.type", "'lora'", "'qlora'"),
        ("method.lora.rslora=true", "method.lora.rslora", "False", "True"),
        ("train.min_lr_ratio=0.1", "train.min_lr_ratio", "0.0", "0.1"),
    ],
    ids=[
        "method",
        "lora-rank",
        "lora-targets",
        "stage",
        "precision",
        "global-batch",
        "data",
        "optimizer",
        "lora-to-qlora",
        "rslora",
        "min-lr",
    ],
)
def test_a_changed_setting_is_refused_naming_the_key(finished, tmp_path, override, key, old, new):
    out, base = copy_run(finished, tmp_path)
    before = listing(out)
    with pytest.raises(CheckpointError) as info:
        resume(base, override)
    message = str(info.value)
    assert "different run" in message and key in message, message
    if old is not None:
        assert f"was {old} in the checkpoint, this run has {new}" in message, message
    assert "train.resume=never" in message
    assert listing(out) == before  # refused before anything was written


def test_another_model_is_refused(finished, tmp_path, tiny_model_dir):
    out, base = copy_run(finished, tmp_path)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(CheckpointError) as info:
        resume({**base, "model": {**base["model"], "path": str(other)}})
    message = str(info.value)
    assert "model.path: the model directory was" in message
    assert "model.path: the sha256 of the model's config.json was" in message


def test_the_cli_refuses_with_exit_2_and_no_traceback(finished, tmp_path):
    _, base = copy_run(finished, tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base))
    done = keel_in_process("train", str(config), "method.lora.r=8", "train.max_steps=4")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "method.lora.r was 4 in the checkpoint, this run has 8" in done.stderr
    assert "Traceback" not in done.stderr


class Evil:
    """Unpickling this runs code: it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_pickled_metadata_is_refused_without_running_it(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    marker = tmp_path / "pwned"
    metadata = out / "checkpoints/step-00000002/state/.metadata"
    metadata.write_bytes(pickle.dumps(Evil(marker)))
    without_hashes(out)  # as a crafted checkpoint's meta.json would: it is no defence alone
    with pytest.raises(CheckpointError, match="pickled object"):
        assert len(resume(base).losses) == 2  # steps 3 and 4, from step 2
    assert not marker.exists()
    # Negative control: plain pickle would have run it.
    pickle.loads(metadata.read_bytes())
    assert marker.exists()


def test_pickled_optimizer_value_is_refused_without_running_it(finished, tmp_path, monkeypatch):
    """An optimizer hyperparameter stored by DCP as pickled bytes holding an object."""
    root, base = finished
    marker = tmp_path / "pwned"
    real = dcp.get_state_dict

    def poisoned(module, optimizer, **kwargs):
        model_state, optim_state = real(module, optimizer, **kwargs)
        optim_state["param_groups"][0]["foreach"] = Evil(marker)
        return model_state, optim_state

    out = tmp_path / "poisoned"
    poisoned_base = {**base, "output": {**base["output"], "dir": str(out)}}
    monkeypatch.setattr(dcp, "get_state_dict", poisoned)
    run_training(load_config(None, [], base=poisoned_base), log=quiet)
    monkeypatch.setattr(dcp, "get_state_dict", real)
    with pytest.raises(CheckpointError, match="pickled object") as info:
        resume(poisoned_base)
    assert "exec" in str(info.value)  # refused for the object it holds, not by accident
    assert not marker.exists()


def test_a_checkpoint_of_an_older_format_is_refused(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    meta_path = out / "checkpoints/step-00000002/meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["format"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="older keel"):
        assert len(resume(base).losses) == 2  # steps 3 and 4, from step 2


def test_checkpoint_files_are_json_and_safetensors(finished):
    root, _ = finished
    step = root / "run/checkpoints/step-00000002"
    trainer = json.loads((step / layout.TRAINER).read_text())
    assert trainer["step"] == 2 and "last_epoch" in trainer["scheduler"]
    assert [p.name for p in (step / "rng").iterdir()] == ["rank-00000.safetensors"]
    meta = json.loads((step / "meta.json").read_text())
    assert meta["format"] == layout.FORMAT_VERSION and meta["global_batch"] == 2
    assert set(meta["run"]) == {
        "model_path",
        "model_config_sha256",
        "method",
        "stage",
        "precision",
        "data_fingerprint",
        "stage_settings",
        "optimizer",
        "model_revision",
    }
    assert not list(step.rglob("*.pt"))


def test_a_checkpoint_from_before_train_optimizer_resumes_as_adamw(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    for meta_path in out.glob("checkpoints/*/meta.json"):
        meta = json.loads(meta_path.read_text())
        del meta["run"]["optimizer"]  # as written before the setting existed
        meta_path.write_text(json.dumps(meta))
    assert len(resume(base).losses) == 2  # steps 3 and 4, from step 2


def test_a_checkpoint_from_before_stage_sections_resumes(finished, tmp_path):
    """keels before per-stage sections recorded a flat `preference:` section: {} in the run
    identity of a stage without preference settings, its defaults in the config."""
    out, base = copy_run(finished, tmp_path)
    for meta_path in out.glob("checkpoints/*/meta.json"):
        meta = json.loads(meta_path.read_text())
        assert meta["run"].pop("stage_settings") == {}
        meta["run"]["preference"] = {}
        meta["config"]["preference"] = {"beta": 0.1, "loss_type": "sigmoid", "gamma": 0.5}
        meta_path.write_text(json.dumps(meta))
    assert len(resume(base).losses) == 2  # steps 3 and 4, from step 2


def _as_before_the_lora_variants(out):
    """Edit the checkpoints' meta.json as keels before rsLoRA, LoRA+, the lr floor and
    data.train_on_prompt wrote it."""
    for meta_path in out.glob("checkpoints/*/meta.json"):
        meta = json.loads(meta_path.read_text())
        for lora in (meta["run"]["method"]["lora"], meta["config"]["method"]["lora"]):
            del lora["rslora"], lora["plus_lr_ratio"]
        del meta["config"]["train"]["min_lr_ratio"], meta["config"]["data"]["train_on_prompt"]
        del meta["config"]["data"]["mask_history"]
        meta_path.write_text(json.dumps(meta))


def test_a_checkpoint_from_before_the_lora_variants_resumes(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    _as_before_the_lora_variants(out)
    assert len(resume(base).losses) == 2  # steps 3 and 4, from step 2
    out, base = copy_run(finished, tmp_path / "rslora")
    _as_before_the_lora_variants(out)
    with pytest.raises(CheckpointError, match="method.lora.rslora was False in the checkpoint"):
        resume(base, "method.lora.rslora=true")  # it ran without: its default


def test_rng_round_trip(tmp_path):
    import random

    import torch

    random.seed(3)
    torch.manual_seed(3)
    save_rng(tmp_path / "rng.safetensors")
    want = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    restore_rng(load_rng(tmp_path / "rng.safetensors"))
    got = (random.random(), torch.rand(3))
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_default_global_batch_counts_processes():
    assert default_global_batch(micro_batch_size=4, grad_accum=2, dp_size=8) == 64
    assert default_global_batch(micro_batch_size=1, grad_accum=1, dp_size=1) == 1


@pytest.mark.parametrize(
    "global_batch,world,mbs,idle",
    [
        (8, 8, 1, None),
        (16, 8, 2, None),
        (4, 8, 4, "4 of 8 processes"),
        (1, 8, 1, "7 of 8"),
        (5, 2, 2, "1 of 2 processes"),
        (4, 2, 1, None),
    ],
)
def test_idle_warning(global_batch, world, mbs, idle):
    plan = StepPlan(
        num_rows=100, global_batch=global_batch, micro_batch_size=mbs, seed=0, shuffle=False
    )
    warning = plan.idle_warning(world)
    if idle is None:
        assert warning is None
    else:
        assert idle in warning and "train.global_batch_size=" in warning


STEP2 = "checkpoints/step-00000002"


def edit_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


@pytest.mark.parametrize(
    "change,expected",
    [
        (lambda t: t.update(step=999), "step is 999 but meta.json says step = 2"),
        (lambda t: t["scheduler"].update(base_lrs=[5.0]), "trainer.json was changed after keel"),
    ],
    ids=["step", "scheduler-lr"],
)
def test_an_edited_trainer_json_is_refused(finished, tmp_path, change, expected):
    """trainer.json's step 2 -> 999 was believed: 'resumed at step 999', nothing trained."""
    out, base = copy_run(finished, tmp_path)
    edit_json(out / STEP2 / "trainer.json", change)
    before = listing(out)
    with pytest.raises(CheckpointError) as info:
        resume(base)
    message = str(info.value)
    assert expected in message and "trainer.json" in message, message
    assert "train.resume=never" in message
    assert listing(out) == before  # refused before anything was written


def without_hashes(out):
    """As checkpoints of older keels are: meta.json records no sha256."""
    for meta_path in out.glob("checkpoints/*/meta.json"):
        edit_json(meta_path, lambda meta: meta.pop("sha256"))


@pytest.mark.parametrize(
    "change,field,values",
    [
        (lambda t: t.update(step=999), "meta.json says step", "step is 999"),
        (
            lambda t: (t.update(step=3), t["scheduler"].update(last_epoch=3)),
            "folder name says step-00000002",
            "step is 3",
        ),
        (lambda t: t["scheduler"].update(last_epoch=7), "scheduler.last_epoch = 7", "step is 2"),
    ],
    ids=["meta", "folder", "scheduler"],
)
def test_a_step_that_disagrees_is_refused_without_hashes(finished, tmp_path, change, field, values):
    out, base = copy_run(finished, tmp_path)
    without_hashes(out)
    if field.startswith("folder"):  # meta.json edited too: only the name tells
        edit_json(out / STEP2 / "meta.json", lambda meta: meta.update(step=3))
    edit_json(out / STEP2 / "trainer.json", change)
    with pytest.raises(CheckpointError) as info:
        resume(base)
    message = str(info.value)
    assert field in message and values in message and "trainer.json" in message, message


def test_a_checkpoint_without_hashes_resumes(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    without_hashes(out)
    assert len(resume(base).losses) == 2  # steps 3 and 4, from step 2


def test_every_small_checkpoint_file_is_hashed(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    meta = json.loads((out / STEP2 / "meta.json").read_text())
    assert set(meta["sha256"]) == {"trainer.json", "state/.metadata", "rng/rank-00000.safetensors"}
    rng = out / STEP2 / "rng/rank-00000.safetensors"
    rng.write_bytes(rng.read_bytes()[:-1] + b" ")
    with pytest.raises(CheckpointError, match="rank-00000.safetensors was changed"):
        resume(base)


def test_a_checkpoint_past_the_last_step_is_refused(finished, tmp_path):
    out, base = copy_run(finished, tmp_path)
    (out / "keel_run.json").unlink()  # an interrupted run (a finished one: test_retraining.py)
    with pytest.raises(CheckpointError) as info:
        run_training(load_config(None, ["train.max_steps=1"], base=base), log=quiet)
    assert "step is 2, beyond this run's 1 steps" in str(info.value)


def test_a_lora_checkpoint_holds_only_the_adapter(finished):
    """The tiny model ties lm_head to the frozen embedding; DCP's ignore_frozen_params
    dropped the embedding under one name only, so lm_head was saved in every checkpoint."""
    root, _ = finished
    state = root / "run" / STEP2 / "state"
    stored = dcp.stored_model_shapes(state)
    assert stored and all(".lora_A." in key or ".lora_B." in key for key in stored), stored
    adapter_bytes = sum(4 * math.prod(shape) for shape in stored.values())  # fp32
    entries = len(dcp.AllowListReader(str(state)).read_metadata().storage_data)
    shards = sum(p.stat().st_size for p in state.glob("*.distcp"))
    # weights and Adam's two moments, plus DCP's ~1.5 KB of framing per stored entry
    assert shards <= 3 * adapter_bytes + 2048 * entries, (shards, adapter_bytes, entries)


def test_a_checkpoint_that_holds_the_tied_frozen_weight_resumes(finished, tmp_path, monkeypatch):
    """Checkpoints of older keels hold lm_head; it is not read, and the run resumes."""
    root, base = finished
    out = tmp_path / "old"
    old_base = {**base, "output": {**base["output"], "dir": str(out)}}
    monkeypatch.setattr(dcp, "_frozen_keys", lambda module: set())
    run_training(load_config(None, [], base=old_base), log=quiet)
    assert any("lm_head" in k for k in dcp.stored_model_shapes(out / STEP2 / "state"))
    monkeypatch.undo()
    assert len(resume(old_base).losses) == 2
