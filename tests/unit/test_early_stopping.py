"""train.early_stopping_patience: the run ends once eval_loss stops improving, and its final
model is the best evaluation's (as Hugging Face's EarlyStoppingCallback with
load_best_model_at_end), whose checkpoint outlives output.keep_last."""

import json
import math

import pytest
import torch
from conftest import QA
from safetensors.torch import load_file

from keel.config import load_config
from keel.errors import ConfigError
from keel.train.early_stop import EarlyStopping
from keel.train.run import run_training


def test_patience_counts_evaluations_without_an_improvement_beyond_the_threshold():
    tracker = EarlyStopping(patience=2, threshold=0.1)
    verdicts = [tracker.update(step, loss) for step, loss in [(2, 3.0), (4, 2.95), (6, 2.5)]]
    assert [(v.improved, v.stop) for v in verdicts] == [
        (True, False),
        (False, False),
        (True, False),
    ]
    assert (tracker.best_step, tracker.best_loss) == (6, 2.5)
    assert not tracker.update(8, 2.45).stop  # 0.05 better: not by more than the threshold
    assert tracker.update(10, 2.7).stop
    restored = EarlyStopping(patience=2, threshold=0.1)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert vars(restored) == vars(tracker)
    fresh = EarlyStopping(patience=1, threshold=0.0)
    fresh.load_state_dict(json.loads(json.dumps(EarlyStopping(1, 0.0).state_dict())))
    assert fresh.best_loss == math.inf and fresh.update(2, 9.0).improved


@pytest.fixture
def qa_file(tmp_path):
    """The QA pairs four times (32 messages rows): 28 to train on, 4 held out."""

    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in QA * 4
    ]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(model_dir, data_file, out, **train):
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(out.parent / "cache")},
        "method": {"type": "full"},
        "data": {"datasets": [str(data_file)], "val_size": 4},
        "train": {
            "max_steps": 20,
            "micro_batch_size": 4,
            "lr": 0.05,  # high and constant: the eval loss bounces within a few steps
            "scheduler": "constant",
            "precision": "fp32",
            "threads": 1,
            "evals_per_epoch": 4,  # 7 steps per epoch (28 rows of 4): every 2 steps
            **train,
        },
        "output": {"dir": str(out), "keep_last": 1, "saves_per_epoch": 1},
    }
    return load_config(None, [], base=base)


def _eval_losses(out) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in lines if "eval_loss" in r}


def test_the_run_stops_and_its_final_model_is_the_best_evaluations(
    tiny_model_dir, qa_file, tmp_path
):
    out = tmp_path / "stopped"
    result = run_training(
        _config(tiny_model_dir, qa_file, out, early_stopping_patience=2), log=print
    )
    evals = _eval_losses(out)
    # the rule, restated over what the run logged
    best_step, best, since = None, math.inf, 0
    for step, loss in sorted(evals.items()):
        best_step, best, since = (step, loss, 0) if loss < best else (best_step, best, since + 1)
        if since == 2:
            break
    assert result.steps == step < 20  # it stopped, where the rule says
    assert max(evals) == step
    assert json.loads((out / "keel_run.json").read_text())["steps"] == step
    assert sorted(evals) == list(range(2, step + 1, 2))
    assert best_step < step  # kept past keep_last 1
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    newest = [f"step-{7 * (step // 7):08d}"] if step >= 7 else []  # saves_per_epoch 1
    assert kept == sorted({f"step-{best_step:08d}", *newest})

    # the final model is the one a run of best_step steps ends with
    short = tmp_path / "short"
    run_training(_config(tiny_model_dir, qa_file, short, max_steps=best_step), log=print)
    final, want = load_file(out / "model.safetensors"), load_file(short / "model.safetensors")
    assert final.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(final[key], want[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    ("train", "data", "problem"),
    [
        ({"early_stopping_patience": 2}, {}, "there is no eval data: set data.val_size"),
        ({"early_stopping_patience": 2, "eval_every": 0}, {"val_size": 2}, "set train.eval_every"),
        ({"eval_every": 5, "evals_per_epoch": 2}, {}, "both set how often to evaluate"),
        ({"early_stopping_patience": -1}, {}, "train.early_stopping_patience"),
        ({"early_stopping_threshold": -0.1}, {}, "train.early_stopping_threshold"),
    ],
)
def test_early_stopping_needs_periodic_evaluations(train, data, problem, tmp_path):
    base = {
        "model": {"path": str(tmp_path)},
        "data": {"datasets": ["d.jsonl"], **data},
        "train": {"eval_every": 5, **train},
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError) as info:
        load_config(None, [], base=base)
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_counts_per_epoch_become_steps():
    from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
    from keel.train.cadence import per_epoch_cadence

    def run_config(**output):
        return RunConfig(
            model=ModelConfig(path="m"),
            data=DataConfig(datasets=[]),
            output=OutputConfig(dir="o", **output),
        )

    cfg = run_config(saves_per_epoch=1)
    cfg.train.evals_per_epoch = 4
    lines = []
    cadenced = per_epoch_cadence(cfg, 10, lines.append)
    assert (cadenced.train.eval_every, cadenced.output.save_every) == (3, 10)  # ceil(10 / 4)
    assert lines == [
        "evaluations: every 3 steps (train.evals_per_epoch 4 of 10 steps per epoch)",
        "checkpoints: every 10 steps (output.saves_per_epoch 1 of 10 steps per epoch)",
    ]
    plain = run_config(save_every=5)
    assert per_epoch_cadence(plain, 10, lines.append) == plain and len(lines) == 2
