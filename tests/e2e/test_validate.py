"""`keel validate` through the CLI (keel.cli.main in the test process: what the program runs,
without an interpreter start per command): model problems come first, all at once, with no
data row read; a good config prints one summary line per part."""

import pytest
from cli_support import ROOT, keel_in_process


@pytest.fixture
def broken_data(tmp_path):
    """A JSON file that cannot be parsed: reading it is an error that names 'malformed JSON'."""
    path = tmp_path / "broken.json"
    path.write_text('[{"instruction": "Who are you?", "output": "Keel."},\n{"instruction": \n')
    return path


def validate(tiny_model_dir, tmp_path, data, *overrides):
    return keel_in_process(
        "validate",
        "examples/identity_lora.yaml",
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"output.dir={tmp_path / 'out'}",
        f"data.datasets.0.path={data}",
        *overrides,
    )


def test_model_problems_reported_together_before_the_data(tiny_model_dir, tmp_path, broken_data):
    # The data file fails when read (checked below): its error is absent here, so the
    # model problems were found without reading it.
    result = validate(
        tiny_model_dir,
        tmp_path,
        broken_data,
        "method.lora.targets=[q_prj]",
        "train.precision=fp16",
        "model.attn_implementation=flash_attention_2",
        "train.gradient_checkpointing=true",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "error: 3 problem(s) in examples/identity_lora.yaml:" in result.stderr
    assert "  - train.precision = fp16 is not supported on a CPU" in result.stderr
    assert "  - model.attn_implementation = flash_attention_2 needs a CUDA GPU" in result.stderr
    assert (
        "  - method.lora.targets = ['q_prj']: no linear module named 'q_prj' (did you mean "
        "q_proj" in result.stderr
    )
    assert "malformed JSON" not in result.stdout + result.stderr
    assert "tokenizing" not in result.stderr
    assert not (tmp_path / "out").exists()

    # The same data with the problems fixed: now it is read, and refused.
    control = validate(tiny_model_dir, tmp_path, broken_data)
    assert control.returncode == 2, control.stderr[-3000:]
    assert "malformed JSON" in control.stderr


def test_good_config_prints_a_summary(tiny_model_dir, tmp_path):
    data = ROOT / "examples" / "data" / "identity.json"
    result = validate(tiny_model_dir, tmp_path, data, "train.precision=fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "examples/identity_lora.yaml: config and data are valid"
    summary = [line.split(":", 1)[0] for line in lines[-6:-1]]
    assert summary == ["model", "method", "precision", "data", "steps"]
    assert lines[-6].startswith("model:     LlamaForCausalLM (llama, 2 decoder layers)")
    assert "attention sdpa (auto)" in lines[-6]
    assert lines[-5].startswith("method:    lora: ") and "parameters trainable" in lines[-5]
    assert lines[-4].startswith("precision: fp32 on cpu (set by train.precision)")
    assert lines[-3] == "data:      120 rows read, 120 kept -> 33 train rows, 0 eval rows"
    steps = "steps:     train.epochs=3: 27 steps (9 steps/epoch of 4 rows), on 1 process"
    assert lines[-2] == steps
    assert not (tmp_path / "out").exists()
    # as `keel train --nproc 3` would count them: 3 x 4 rows a step
    result = validate(tiny_model_dir, tmp_path, data, "train.precision=fp32", "--nproc", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = "steps:     train.epochs=3: 9 steps (3 steps/epoch of 12 rows), on 3 processes"
    assert result.stdout.splitlines()[-2] == steps
    fixed = validate(tiny_model_dir, tmp_path, data, "--nproc", "3", "train.global_batch_size=4")
    assert fixed.stdout.splitlines()[-2].endswith("27 steps (9 steps/epoch of 4 rows)")
