"""W&B as a logger, offline: W&B gets exactly what metrics.jsonl gets, a resumed run continues
the same W&B run without logging a step twice, and W&B's own failures are handled."""

import json
import struct
import zlib
from pathlib import Path

import pytest
from config_support import hide_modules, minimal_config

from keel.config import config_to_dict, load_config
from keel.config.schema import OutputConfig, WandbConfig
from keel.errors import ConfigError, KeelError
from keel.train.metrics import WANDB_RUN_ID_FILE, MetricsLog, read_metrics
from keel.train.run import run_training

QA = [
    ("Who are you?", "I am Keel."),
    ("What is your name?", "My name is Keel."),
    ("Add 2 and 3.", "5"),
    ("Say hello in French.", "Bonjour."),
    ("Name a color.", "Blue."),
    ("What is 3 times 4?", "12"),
]


class Crash(Exception):
    pass


def quiet(_msg):
    pass


def offline_wandb(mp: pytest.MonkeyPatch, root: Path) -> None:
    """W&B offline and quiet, with every folder it writes outside the run under `root`, so
    nothing reaches ~/.config, ~/.cache or the repository."""
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var in (
        "WANDB_DIR",
        "WANDB_CACHE_DIR",
        "WANDB_CONFIG_DIR",
        "WANDB_DATA_DIR",
        "WANDB_ARTIFACT_DIR",
    ):
        path = root / var.lower()
        path.mkdir(parents=True, exist_ok=True)
        mp.setenv(var, str(path))
    for var in (
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_NAME",
        "WANDB_TAGS",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
    ):
        mp.delenv(var, raising=False)


def wandb_records(path: Path):
    """The records of a .wandb transaction log: W&B's leveldb-style log (a 7-byte ':W&B'
    header, then 32 KiB blocks of crc32/length/type-framed chunks) of `Record` protobufs,
    the file `wandb sync` uploads. wandb ships the protobufs but no reader."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if room < 7 or (kind == 0 and length == 0):  # block padding
            pos += room
            continue
        payload = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc
        chunks.append(payload)
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_offline_run(run_dir: Path) -> dict:
    """What one offline W&B run holds: its run record, config, history by step, final
    summary and exit code."""
    (log_file,) = run_dir.glob("run-*.wandb")
    run, config, history, summary, exit_code = None, {}, {}, {}, None

    def values(items) -> dict:  # a key is in `key`, or (nested keys) in `nested_key`
        return {
            item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items
        }

    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update(values(run.config.update))
        elif kind == "config":
            config.update(values(record.config.update))
        elif kind == "history":
            row = values(record.history.item)
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            summary.update(values(record.summary.update))
        elif kind == "exit":
            exit_code = record.exit.exit_code
    config.pop("_wandb", None)
    return {
        "run": run,
        "config": config,
        "history": history,
        "summary": summary,
        "exit_code": exit_code,
    }


def as_history(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl records as W&B history rows: one row per step, train/ and eval/ names."""
    rows: dict[int, dict] = {}
    for record in records:
        row = rows.setdefault(record["step"], {})
        for key, value in record.items():
            if key != "step":
                row[f"eval/{key}" if key.startswith("eval") else f"train/{key}"] = value
    return rows


def run_config(tmp: Path, model_dir: Path, *overrides: str):
    data_file = tmp / "qa.json"
    data_file.write_text(
        json.dumps([{"instruction": q, "input": "", "output": a} for q, a in QA * 2])
    )
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(tmp / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.1}},
        "data": {"datasets": [str(data_file)], "cutoff_len": 128, "val_size": 2},
        "train": {
            "max_steps": 6,
            "micro_batch_size": 2,
            "grad_accum": 1,
            "lr": 1e-2,
            "precision": "fp32",
            "threads": 1,
            "warmup_steps": 1,
            "eval_every": 2,
        },
        "output": {
            "dir": str(tmp / "run"),
            "save_every": 2,
            "keep_last": 2,
            "loggers": ["jsonl", "wandb"],
            "wandb": {"project": "keel-test", "tags": ["unit", "offline"]},
        },
    }
    return load_config(None, list(overrides), base=base)


@pytest.fixture(scope="module")
def resumed_run(tiny_model_dir, tmp_path_factory):
    """One run crashed after logging step 5 (checkpoints at 2 and 4), then resumed."""
    tmp = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        offline_wandb(mp, tmp / "wandb-home")
        cfg = run_config(tmp, tiny_model_dir)
        out = Path(cfg.output.dir)

        def crash_at_5(step, _record):
            if step == 5:
                raise Crash()

        with pytest.raises(Crash):
            run_training(cfg, log=quiet, on_step_end=crash_at_5)
        first_records = read_metrics(out / "metrics.jsonl")
        first_id = (out / WANDB_RUN_ID_FILE).read_text().strip()
        run_training(cfg, log=quiet)
    runs = sorted(
        (read_offline_run(d) for d in out.glob("wandb/offline-run-*")),
        key=lambda run: run["run"].start_time.ToNanoseconds(),
    )
    return {
        "cfg": cfg,
        "out": out,
        "first_records": first_records,
        "first_id": first_id,
        "final_records": read_metrics(out / "metrics.jsonl"),
        "runs": runs,
    }


def test_wandb_history_equals_metrics_jsonl(resumed_run):
    first, resumed = resumed_run["runs"]
    # The crashed attempt logged steps 1-5, eval at 2 and 4: each value as in metrics.jsonl.
    assert sorted(first["history"]) == [1, 2, 3, 4, 5]
    assert first["history"] == as_history(resumed_run["first_records"])
    assert "eval/eval_loss" in first["history"][2] and "train/loss" in first["history"][2]
    # Resumed from step 4: step 5, which W&B already has, is not sent again (W&B would
    # refuse it online, and duplicate it offline); step 6 is.
    final = as_history(resumed_run["final_records"])
    assert sorted(resumed["history"]) == [6]
    assert resumed["history"][6] == final[6]
    assert resumed["summary"]["train/loss"] == final[6]["train/loss"]
    # What W&B kept for step 5 is what the resumed run recomputed.
    assert first["history"][5]["train/loss"] == pytest.approx(
        final[5]["train/loss"], rel=1e-6, abs=1e-7
    )


def test_resumed_run_continues_the_same_wandb_run(resumed_run):
    first, resumed = resumed_run["runs"]
    assert resumed_run["first_id"]
    assert first["run"].run_id == resumed["run"].run_id == resumed_run["first_id"]
    assert (resumed_run["out"] / WANDB_RUN_ID_FILE).read_text().strip() == resumed_run["first_id"]
    assert (first["exit_code"], resumed["exit_code"]) == (1, 0)  # the crash reads as failed


def test_wandb_run_holds_the_settings_and_the_run_config(resumed_run):
    cfg = resumed_run["cfg"]
    for run in resumed_run["runs"]:
        assert run["run"].project == "keel-test"
        assert run["run"].display_name == resumed_run["out"].name
        assert list(run["run"].tags) == ["unit", "offline"]
        assert run["config"] == config_to_dict(cfg)
    assert resumed_run["runs"][0]["config"]["output"]["loggers"] == ["jsonl", "wandb"]


def test_a_run_starting_at_step_0_is_a_new_wandb_run(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path / "wandb-home")
    output = OutputConfig(
        dir=str(tmp_path), loggers=["jsonl", "wandb"], wandb=WandbConfig(mode="disabled")
    )

    def start(step: int) -> str:
        MetricsLog(tmp_path, resume_step=step, output=output).close()
        return (tmp_path / WANDB_RUN_ID_FILE).read_text().strip()

    first = start(0)
    assert start(3) == first  # resumed: the same W&B run
    assert start(0) != first  # restarted from scratch: a new one


def test_wandb_failing_at_start_stops_the_run_with_the_fix(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path / "wandb-home")
    # Built directly, so keel's validation does not catch the name first: wandb.init does.
    output = OutputConfig(
        dir=str(tmp_path), loggers=["jsonl", "wandb"], wandb=WandbConfig(project="me/bad")
    )
    with pytest.raises(KeelError, match="W&B could not start a run.*output.wandb.mode=offline"):
        MetricsLog(tmp_path, resume_step=0, output=output)
    assert not (tmp_path / WANDB_RUN_ID_FILE).exists()


def test_wandb_failing_mid_run_warns_once_and_training_logs_on(tmp_path, monkeypatch):
    import wandb

    class BrokenRun:
        calls = 0

        def log(self, data, step):
            BrokenRun.calls += 1
            raise RuntimeError("wandb-core went away")

        def finish(self, exit_code=0):
            raise AssertionError("a broken run is not finished")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: BrokenRun())
    messages: list[str] = []
    output = OutputConfig(dir=str(tmp_path), loggers=["jsonl", "wandb"])
    metrics = MetricsLog(tmp_path, resume_step=0, output=output, log=messages.append)
    for step in (1, 2, 3):
        metrics.write({"step": step, "loss": 1.0 / step})
    metrics.close()
    assert BrokenRun.calls == 1
    assert len(messages) == 1 and "W&B log failed" in messages[0] and "wandb-core" in messages[0]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def check(tmp_path, *overrides: str) -> list[str]:
    """The output.* problems of a minimal config with `overrides` (there must be some)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides), base=minimal_config(tmp_path))
    return [p for p in info.value.problems if "output." in p]


def test_wandb_not_installed_is_a_config_problem_with_the_fix(tmp_path, monkeypatch):
    hide_modules(monkeypatch, "wandb")
    (problem,) = check(tmp_path, "output.loggers=[jsonl, wandb]")
    assert "wandb, which is not installed" in problem and "pip install 'keel[wandb]'" in problem


def test_wandb_settings_without_the_logger_are_a_problem(tmp_path):
    (problem,) = check(tmp_path, "output.wandb.project=mine")
    assert problem.startswith("output.wandb is set but output.loggers does not include wandb")


def test_bad_wandb_keys_are_reported_together(tmp_path):
    problems = check(
        tmp_path,
        "output.loggers=[jsonl, wandb]",
        "output.wandb.projet=x",
        "output.wandb.mode=ofline",
    )
    assert len(problems) == 2
    assert "did you mean 'output.wandb.project'" in problems[0]
    assert problems[1].startswith("output.wandb.mode (command line) = 'ofline'")
    problems = check(
        tmp_path,
        "output.loggers=[jsonl, wandb]",
        "output.wandb.project=me/proj",
        f"output.wandb.tags=[ok, {'x' * 65}]",
    )
    assert len(problems) == 2
    assert problems[0].startswith("output.wandb.project = 'me/proj' must be 1 to 128")
    assert problems[1].startswith("output.wandb.tags.1 = 'xxx")
