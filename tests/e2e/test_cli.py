"""The CLI the way users run it: shipped examples, bad input, chat.

Bad input goes through the real program (its exit status and stderr); the runs go through
keel.cli.main in this process (what the program runs: the same parsing, checks and training),
which spares each of them an interpreter start and the torch/transformers imports."""

import json

import pytest
from cli_support import ROOT, keel, keel_in_process

SMALL_EXAMPLES = [
    "sharegpt_full.yaml",
    "messages_freeze.yaml",
    "pretrain_text.yaml",
    "pretrain_streaming.yaml",
    "llamafactory_lora.yaml",
    "identity_lora.yaml",
    "identity_qlora.yaml",
    "fsdp_full.yaml",
    "dpo_bundled.yaml",
    "orpo_bundled.yaml",
    "simpo_bundled.yaml",
    "kto_bundled.yaml",
    "llamafactory_dpo.yaml",
    "grpo_sums.yaml",
]


# Examples run by their own tests (a vision-language model, not the tiny text model)
RUN_ELSEWHERE = {
    "vision_llava_demo.yaml": "tests/e2e/test_vision_demo.py",
    "pretrain_long_context.yaml": "tests/distributed/test_context_parallel.py",  # 2 processes
    "sft_tensor_parallel.yaml": "tests/distributed/test_tensor_parallel.py",  # 2 processes
}


def test_every_example_is_covered_here():
    shipped = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
    assert shipped == sorted([*SMALL_EXAMPLES, *RUN_ELSEWHERE])
    assert all((ROOT / test).is_file() for test in RUN_ELSEWHERE.values())


@pytest.mark.parametrize("example", SMALL_EXAMPLES)
def test_shipped_example_runs_on_a_tiny_model(example, tiny_model_dir, tmp_path):
    """Each example, with the tiny model swapped in, trains 2 steps and writes its outputs."""
    out = tmp_path / "out"
    result = keel_in_process(
        "train",
        f"examples/{example}",
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"output.dir={out}",
        "train.max_steps=2",
        "train.precision=fp32",
        "train.threads=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert (out / "keel_run.json").is_file() and (out / "config.yaml").is_file()


def test_bad_config_exits_2_with_every_problem(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "model: {path: bundled:smollm2-135m-instruct}\ndata: {datasets: [x.json], "
        "packin: true}\ntrain: {lr: fast}\noutput: {dir: out}\n"
    )
    result = keel("train", str(cfg))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "did you mean 'data.packing'" in result.stderr
    assert "train.lr" in result.stderr and "must be a number" in result.stderr


def test_bad_data_exits_2_and_writes_nothing(tiny_model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": ""}\n')
    out = tmp_path / "out"
    result = keel_in_process(
        "train",
        "examples/identity_lora.yaml",
        f"model.path={tiny_model_dir}",
        f"data.datasets.0.path={data}",
        f"output.dir={out}",
        f"model.cache_dir={tmp_path / 'cache'}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "bad.jsonl" in result.stderr and "empty" in result.stderr
    assert not out.exists()


def test_chat_prompt_after_training(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    trained = keel_in_process(
        "train",
        "examples/identity_lora.yaml",
        f"model.path={tiny_model_dir}",
        f"output.dir={out}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=1",
        "train.precision=fp32",
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    reply = keel_in_process(
        "chat",
        "--model",
        str(out),
        "--prompt",
        "Who are you?",
        "--max-new-tokens",
        "5",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert reply.returncode == 0, reply.stderr[-2000:]
    assert reply.stdout.strip()


def test_validate_reports_data_and_trains_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = keel_in_process(
        "validate",
        "examples/llamafactory_lora.yaml",
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"output.dir={out}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "alpaca_mini.json" in result.stdout and "chat_mini.json" in result.stdout
    assert "config and data are valid" in result.stdout
    assert not out.exists()
