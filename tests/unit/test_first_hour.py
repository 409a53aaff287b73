"""What a new user notices first: attention chosen per model, the steps a run takes, the
model card, a busy machine, and progress lines when the output is not a terminal."""

import json

import pytest
from conftest import build_tiny_tokenizer

from keel.config import load_config
from keel.export import ExportRequest, export_model
from keel.models.attention import auto_attention
from keel.train.batch_source import StepPlan
from keel.train.metrics import Progress
from keel.train.run import run_training
from keel.train.threads import busy_warning, set_threads


def config(model_dir, data_file, out, *overrides):
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(out.parent / "cache")},
        "data": {"datasets": [str(data_file)], "cutoff_len": 128},
        "train": {"max_steps": 1, "micro_batch_size": 2, "precision": "fp32", "threads": 1},
        "output": {"dir": str(out)},
    }
    return load_config(None, list(overrides), base=base)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """A tiny random Gemma 2 (which has no sdpa path in transformers) with a tokenizer."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = tmp_path_factory.mktemp("gemma2")
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    Gemma2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_default_attention_is_auto_and_gemma2_trains_with_eager(gemma2_dir, data_file, tmp_path):
    lines: list[str] = []
    cfg = config(gemma2_dir, data_file, tmp_path / "out")
    assert cfg.model.attn_implementation == "auto"
    result = run_training(cfg, log=lines.append)
    assert len(result.losses) == 1
    assert any("Gemma2ForCausalLM" in s and "attention eager (auto)" in s for s in lines), lines


def test_auto_attention_picks_sdpa_for_llama(tiny_model_dir, data_file, tmp_path):
    lines: list[str] = []
    run_training(config(tiny_model_dir, data_file, tmp_path / "out"), log=lines.append)
    assert any("attention sdpa (auto)" in line for line in lines), lines
    assert any(line.startswith("micro-batches: padding-free") for line in lines), lines


def test_auto_attention_picks_flash_attention_on_a_gpu_with_flash_attn(monkeypatch):
    import torch
    import transformers.utils
    from transformers import Gemma2Config, LlamaConfig

    assert auto_attention(LlamaConfig()) is None  # no GPU here: transformers' own choice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert auto_attention(LlamaConfig()) == "flash_attention_2"
    assert auto_attention(Gemma2Config()) == "flash_attention_2"
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert auto_attention(LlamaConfig()) is None


def test_explicit_attention_is_kept(tiny_model_dir, data_file, tmp_path):
    lines: list[str] = []
    cfg = config(tiny_model_dir, data_file, tmp_path / "out", "model.attn_implementation=eager")
    run_training(cfg, log=lines.append)
    assert any("attention eager;" in line for line in lines), lines


def test_max_steps_overrides_epochs_and_says_so(tiny_model_dir, data_file, tmp_path):
    plan = StepPlan(num_rows=16, global_batch=4, micro_batch_size=4, seed=0, shuffle=True)
    assert plan.schedule(1, 12) == (
        "train.max_steps=12 overrides train.epochs=1: 12 steps = 3 epochs (4 steps/epoch of 4 rows)"
    )
    assert plan.schedule(2, None) == "train.epochs=2: 8 steps (4 steps/epoch of 4 rows)"
    lines: list[str] = []
    cfg = config(tiny_model_dir, data_file, tmp_path / "out", "train.max_steps=6")
    run_training(cfg, log=lines.append)
    assert "steps: train.max_steps=6 overrides train.epochs=1: 6 steps = 0.75 epochs" in (
        "\n".join(lines)
    )


def test_model_card_names_base_data_and_final_loss(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "out"
    cfg = config(tiny_model_dir, data_file, out, "train.max_steps=2", "output.merge_lora=true")
    result = run_training(cfg, log=lambda _: None)
    loss = json.loads((out / "keel_run.json").read_text())["final_loss"]
    for folder, kind in ((out, "LoRA adapter"), (out / "merged", "model")):
        card = (folder / "README.md").read_text()
        assert "[More Information Needed]" not in card
        assert f"A {kind} trained with keel" in card
        assert f"`{tiny_model_dir}`" in card and f"`{data_file}`" in card
        assert f"| final training loss | {loss:.4f} |" in card and "| steps | 2 |" in card
        assert f"keel chat --model {folder}" in card
    assert result.steps == 2
    exported = export_model(ExportRequest(model=str(out), out=tmp_path / "exported"))
    card = (exported / "README.md").read_text()
    assert "A model exported (merged) with keel" in card and f"`{tiny_model_dir}`" in card
    assert f"| final training loss | {loss:.4f} |" in card and "| method | lora |" in card


def test_busy_machine_warning(monkeypatch):
    assert busy_warning(0.3, 2, 2) is None  # this command's own start-up
    assert busy_warning(1.0, 2, 4) is None
    warning = busy_warning(13.2, 2, 2)
    assert "load average 13.2 on 2 cores" in warning and "train.threads=1" in warning
    monkeypatch.setattr("os.getloadavg", lambda: (13.2, 10.0, 8.0))
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    said, details = [], []
    assert set_threads(0, 1, said.append, details.append) == 2
    assert details == ["threads: 2 per process"]
    assert len(said) == 1 and said[0].startswith("warning: this machine is busy")


def test_progress_off_a_terminal_is_one_plain_line_per_logged_step(capsys):
    lines: list[str] = []
    bar = Progress(total=3, initial=0, log=lines.append, interactive=False)
    bar.update(2.123456789, 1e-3, 1234.5)
    bar.update(None, 1e-3, 1000.0)  # a step that is not logged
    bar.write("step 2: eval_loss 2.0000")
    bar.update(1.5, 5e-4, 2000.0)
    bar.close()
    assert lines == [
        "step 1/3: loss 2.1235, lr 1.00e-03, 1,234 tokens/s",
        "step 2: eval_loss 2.0000",
        "step 3/3: loss 1.5000, lr 5.00e-04, 2,000 tokens/s",
    ]
    assert "\r" not in capsys.readouterr().err
