"""Stopping early without losing or faking work: divergence (exit 6) and preemption (exit 7)."""

import json
import math
import os
import re
import signal

import pytest
from config_support import tiny_lora_config

from keel.checkpoint.layout import complete_checkpoints
from keel.config import load_config
from keel.errors import Diverged, Preempted
from keel.train.metrics import MetricsLog
from keel.train.run import run_training

FINAL_OUTPUTS = ("keel_run.json", "adapter_model.safetensors", "adapter_config.json")


def config(model_dir, data_file, out, *overrides):
    output = {"keep_last": 2, "log_every": 4}
    train = {"max_steps": 6}
    base = tiny_lora_config(model_dir, data_file, out, cutoff_len=128, train=train, output=output)
    return load_config(None, list(overrides), base=base)


def quiet(_msg):
    pass


def strict_records(path):
    """metrics.jsonl read as strict JSON: bare NaN/Infinity raise."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.open()]


def assert_diverged_run_left(out, kept: str):
    assert [p.name for p in complete_checkpoints(out)] == [kept]
    for name in FINAL_OUTPUTS:
        assert not (out / name).exists(), name
    strict_records(out / "metrics.jsonl")  # valid JSON, whatever it holds


def test_a_nan_step_stops_the_run_before_any_save(tiny_model_dir, data_file, tmp_path, monkeypatch):
    # Step 3's loss turns NaN. Step 4 saves but does not log (log_every 5): a check at log
    # steps alone would save NaN weights as step-4 and publish them at the end.
    monkeypatch.setenv("KEEL_FAULT", "nan:3")
    out = tmp_path / "run"
    with pytest.raises(Diverged, match="diverged at step 3: the loss is nan") as caught:
        run_training(config(tiny_model_dir, data_file, out, "output.log_every=5"), log=quiet)
    assert caught.value.exit_code == 6
    assert "step-00000002" in str(caught.value)  # the checkpoint that is kept
    assert_diverged_run_left(out, "step-00000002")


def test_a_huge_learning_rate_diverges(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    cfg = config(
        tiny_model_dir,
        data_file,
        out,
        "train.lr=1e6",
        "train.max_grad_norm=0",
        "output.log_every=1",
        "output.save_every=1",
        "train.max_steps=20",
    )
    with pytest.raises(Diverged, match=r"diverged at step (\d+): the (loss|gradient norm)") as e:
        run_training(cfg, log=quiet)
    step = int(re.search(r"step (\d+)", str(e.value)).group(1))
    assert step >= 2  # step 1 is computed on the base weights
    assert_diverged_run_left(out, f"step-{step - 1:08d}")
    last = strict_records(out / "metrics.jsonl")[-1]
    assert last["step"] == step and None in (last["loss"], last["grad_norm"])


def test_metrics_write_non_finite_numbers_as_null(tiny_model_dir, data_file, tmp_path):
    cfg = config(tiny_model_dir, data_file, tmp_path / "out")
    metrics = MetricsLog(tmp_path, resume_step=0, output=cfg.output)
    metrics.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    metrics.close()
    (record,) = strict_records(tmp_path / "metrics.jsonl")
    assert record == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1}


@pytest.fixture
def survivable():
    """Without keel's handling a signal would end pytest itself: the test's own handler
    catches it instead (run_training's replaces it while it runs, then gives it back)."""
    mine = {}
    for number in (signal.SIGTERM, signal.SIGUSR1):
        mine[number] = signal.signal(number, lambda _n, _f: None)
    yield
    for number, previous in mine.items():
        signal.signal(number, previous)


def test_sigusr1_saves_at_the_step_and_the_rerun_equals_an_uninterrupted_run(
    tiny_model_dir, data_file, tmp_path, survivable
):
    args = ("train.preempt_signal=SIGUSR1", "output.save_every=0", "output.log_every=1")
    full = run_training(config(tiny_model_dir, data_file, tmp_path / "full", *args), log=quiet)

    def signal_after_3(step, _record):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    out = tmp_path / "run"
    cfg = config(tiny_model_dir, data_file, out, *args)
    with pytest.raises(Preempted, match="SIGUSR1.*finished step 3.*same command") as caught:
        run_training(cfg, log=quiet, on_step_end=signal_after_3)
    assert caught.value.exit_code == 7
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000003"]
    assert not (out / "keel_run.json").exists()
    resumed = run_training(cfg, log=quiet)
    assert resumed.losses == full.losses[3:]
    assert [r["step"] for r in strict_records(out / "metrics.jsonl")] == list(range(1, 7))


def test_sigterm_during_set_up_stops_at_once_with_exit_7(
    tiny_model_dir, data_file, tmp_path, survivable
):
    def log(message):
        if message.startswith("model ready"):
            os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "run"
    with pytest.raises(Preempted, match="SIGTERM arrived before the first training step"):
        run_training(config(tiny_model_dir, data_file, out), log=log)
    assert not out.exists() or complete_checkpoints(out) == []
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the test's handler is back


def test_keel_fault_is_read_after_a_library_rebinds_os_environ(monkeypatch):
    """datasets' map with num_proc > 1 leaves `os.environ` a new object; the fault hook must
    still see a KEEL_FAULT set afterwards (it read the import-time object before)."""
    from keel.faults import fault_from_env

    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setenv("KEEL_FAULT", "nan:3")
    fault = fault_from_env()
    assert fault is not None and (fault.kind, fault.step) == ("nan", 3)


def test_skipped_steps_count_runs_of_overflowing_steps_across_windows():
    from keel.train.stops import MIN_LOSS_SCALE, SkippedSteps

    skipped, nan, inf = SkippedSteps(), float("nan"), float("inf")
    skipped.add([1.0, 2.0, nan], [0.5, inf, nan], first_step=1)  # step 2: grads overflowed
    assert skipped.since == 2
    skipped.add([1.5], [0.7], first_step=4)  # a good step ends the run: calibration
    assert skipped.since is None
    skipped.check(4, scale=MIN_LOSS_SCALE / 4, newest=lambda: None)  # nothing skipped now
    skipped.add([nan, nan], [nan, nan], first_step=5)
    skipped.check(6, scale=MIN_LOSS_SCALE, newest=lambda: None)  # the scale may still find one
    with pytest.raises(Diverged, match=r"under fp16 at step 6: every step since step 5") as e:
        skipped.check(6, scale=MIN_LOSS_SCALE / 2, newest=lambda: None)
    assert e.value.exit_code == 6 and "train.precision" in str(e.value)


@pytest.fixture
def fp16_on_this_cpu(monkeypatch):
    """train.precision=fp16 accepted on a CPU (refused there for speed; the loss scaler and
    autocast work)."""
    import keel.train.preflight as preflight
    from keel.precision import Precision

    real = preflight.resolve_precision

    def resolve(requested, device):
        return Precision("fp16", "test") if requested == "fp16" else real(requested, device)

    monkeypatch.setattr(preflight, "resolve_precision", resolve)


def test_an_fp16_step_that_overflows_once_is_skipped_and_the_run_goes_on(
    tiny_model_dir, data_file, tmp_path, monkeypatch, fp16_on_this_cpu
):
    monkeypatch.setenv("KEEL_FAULT", "nan:3")  # step 3's forward turns NaN, once
    overrides = ("train.precision=fp16", "output.log_every=1")
    result = run_training(
        config(tiny_model_dir, data_file, tmp_path / "run", *overrides), log=quiet
    )
    losses = result.losses
    assert len(losses) == 6 and math.isnan(losses[2]) and all(map(math.isfinite, losses[3:]))


def test_an_fp16_run_that_overflows_at_every_step_stops(
    tiny_model_dir, data_file, tmp_path, fp16_on_this_cpu
):
    """The loss scaler skips every step of a blown-up model (lr 1e6): without this stop the
    run would skip them all to the end and report success."""
    out = tmp_path / "run"
    overrides = ("train.precision=fp16", "train.lr=1e6", "train.max_grad_norm=0",
                 "output.log_every=1", "train.max_steps=40")  # fmt: skip
    with pytest.raises(Diverged, match=r"under fp16 at step (\d+): every step since step") as e:
        run_training(config(tiny_model_dir, data_file, out, *overrides), log=quiet)
    scale = re.search(r"its scale fell to (\S+), below 1:", str(e.value))
    assert scale and float(scale.group(1)) < 1, str(e.value)  # 2**16 halved 17+ times
    for name in FINAL_OUTPUTS:
        assert not (out / name).exists(), name
