"""Whole runs on a tiny model: outputs, resume parity, atomic checkpoints, output-dir safety."""

import json

import pytest
import torch

import keel.checkpoint.commit as commit
from keel.checkpoint.layout import complete_checkpoints
from keel.config import load_config
from keel.errors import DataError, KeelError
from keel.train.run import run_training


class Crash(Exception):
    pass


def config(model_dir, data_file, out, *overrides, method="lora"):
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(out.parent / "cache")},
        "method": {"type": method, "lora": {"r": 4, "alpha": 8, "dropout": 0.1}},
        "data": {"datasets": [str(data_file)], "cutoff_len": 128, "val_size": 2},
        "train": {
            "max_steps": 6,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "lr": 1e-2,
            "precision": "fp32",
            "threads": 1,
            "warmup_steps": 1,
        },
        "output": {"dir": str(out), "save_every": 2, "keep_last": 2},
    }
    return load_config(None, list(overrides), base=base)


def quiet(_msg):
    pass


# lora-plus: LoRA+ groups and rsLoRA's scale, whose lr ratio the resumed schedule keeps
METHOD_OVERRIDES = {
    "lora": (),
    "full": (),
    "lora-plus": ("method.lora.plus_lr_ratio=16", "method.lora.rslora=true"),
    # the tiny model's embeddings, tied to its output layer, trained in full beside LoRA
    "lora-embeddings": ("method.lora.modules_to_save=[embed_tokens]",),
    # QAT rounded from step 6 on: the run resumed at step 5 must not round it (the rounding
    # is read from the step, not carried from the step that switched it on)
    "full-qat": ("method.qat.scheme=int8-int4", "method.qat.start_step=5"),
    # Muon's momentum buffers (the matrices) beside AdamW's moments (the rest)
    "full-muon": ("train.optimizer=muon",),
    # streamed rows (shuffled in blocks of 5 rows, BLOCK_ROWS patched below; 6 a step): the
    # step-4 checkpoint's cursor points at row 3 of the second block of the second epoch
    "lora-streaming": ("data.streaming=true", "data.val_size=0", "train.micro_batch_size=3"),
    # OFT's rotations (blocks of 16: two per layer of 32 inputs) and their AdamW moments
    "oft": ("method.oft.block_size=16",),
}


@pytest.mark.parametrize("method", list(METHOD_OVERRIDES))
def test_resumed_run_matches_uninterrupted(
    tiny_model_dir, data_file, tmp_path, method, monkeypatch
):
    if method == "lora-streaming":
        import keel.data.stream

        monkeypatch.setattr(keel.data.stream, "BLOCK_ROWS", 5)

    def method_config(model_dir, data_file, out, method):
        overrides = METHOD_OVERRIDES[method]
        return config(model_dir, data_file, out, *overrides, method=method.split("-")[0])

    full = run_training(
        method_config(tiny_model_dir, data_file, tmp_path / "a", method=method), log=quiet
    )
    assert len(full.losses) == 6
    if method == "lora-plus":  # the ratio and the scale reach the run
        saved = json.loads((tmp_path / "a/adapter_config.json").read_text())
        assert saved["use_rslora"] is True
        plain = run_training(
            config(tiny_model_dir, data_file, tmp_path / "p", "train.max_steps=2"), log=quiet
        )
        assert plain.losses[1] != pytest.approx(full.losses[1], rel=1e-4)
    if method == "lora-embeddings":  # the adapter folder holds the trained matrix
        from safetensors import safe_open

        with safe_open(tmp_path / "a/adapter_model.safetensors", "pt") as f:
            (name,) = [k for k in f.keys() if "embed_tokens" in k]
            trained = f.get_tensor(name)
        with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
            assert not torch.equal(trained, f.get_tensor("model.embed_tokens.weight"))

    if method == "oft":  # the rotations trained away from the identity (zero) they start at
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "a/adapter_model.safetensors")
        assert saved and all(".oft_R." in k and t.abs().max() > 1e-4 for k, t in saved.items())
    if method == "full-qat":  # unrounded before step 6, rounded at it
        plain = run_training(
            config(tiny_model_dir, data_file, tmp_path / "p", method="full"), log=quiet
        )
        assert full.losses[:5] == pytest.approx(plain.losses[:5], rel=1e-6, abs=1e-7)
        assert abs(full.losses[5] - plain.losses[5]) > 1e-5

    def crash_at_5(step, _record):
        if step == 5:
            raise Crash()

    cfg_b = method_config(tiny_model_dir, data_file, tmp_path / "b", method=method)
    with pytest.raises(Crash):
        run_training(cfg_b, log=quiet, on_step_end=crash_at_5)
    assert [p.name for p in complete_checkpoints(tmp_path / "b")] == [
        "step-00000002",
        "step-00000004",
    ]
    resumed = run_training(cfg_b, log=quiet)
    assert len(resumed.losses) == 2  # steps 5 and 6, from the step-4 checkpoint
    assert resumed.losses == pytest.approx(full.losses[4:], rel=1e-6, abs=1e-7)
    steps = [
        r["step"] for r in map(json.loads, (tmp_path / "b/metrics.jsonl").open()) if "loss" in r
    ]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_outputs_of_a_finished_run(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    result = run_training(
        config(
            tiny_model_dir,
            data_file,
            out,
            "output.merge_lora=true",
            "output.loggers=[jsonl, tensorboard]",
        ),
        log=quiet,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 7))
    for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm", "rss_mb"):
        assert key in train[0]
    assert any("eval_loss" in r and "eval_ppl" in r for r in records)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert (out / "merged/config.json").is_file()
    assert (out / "loss.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    summary = json.loads((out / "keel_run.json").read_text())
    assert summary["steps"] == 6 and summary["real_tokens"] > 0 and summary["peak_rss_mb"] > 0
    assert result.summary == summary
    assert len(complete_checkpoints(out)) == 2  # keep_last


def test_crash_mid_save_never_looks_complete(tiny_model_dir, data_file, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def broken_commit(tmp, final):
        raise OSError("disk full")

    monkeypatch.setattr(commit, "commit_dir", broken_commit)
    with pytest.raises(OSError):
        run_training(config(tiny_model_dir, data_file, out), log=quiet)
    assert complete_checkpoints(out) == []
    assert (out / "checkpoints/.tmp-step-00000002").is_dir()
    monkeypatch.undo()
    result = run_training(config(tiny_model_dir, data_file, out), log=quiet)
    assert len(result.losses) == 6  # started over: the partial save was not a checkpoint
    assert not (out / "checkpoints/.tmp-step-00000002").exists()


def test_bad_data_leaves_no_output_dir(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "hi", "output": "hello"}\n{"instruction": \n')
    out = tmp_path / "never"
    with pytest.raises(DataError, match="line 2"):
        run_training(config(tiny_model_dir, bad, out), log=quiet)
    assert not out.exists()


def test_non_empty_output_dir_is_refused(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(KeelError, match="not empty"):
        run_training(config(tiny_model_dir, data_file, out, "train.resume=never"), log=quiet)
    assert (out / "precious.txt").read_text() == "keep me"


def test_bf16_autocast_training_runs(tiny_model_dir, data_file, tmp_path):
    result = run_training(
        config(
            tiny_model_dir,
            data_file,
            tmp_path / "bf16",
            "train.precision=bf16",
            "train.max_steps=2",
        ),
        log=quiet,
    )
    assert result.summary["precision"] == "bf16"
    assert all(loss == loss and loss < 20 for loss in result.losses)  # finite, sane


def test_the_saved_tokenizer_keeps_the_training_template(tiny_model_dir, data_file, tmp_path):
    """Trained with data.template=chatml (no default system prompt, unlike the tokenizer's
    own): chat, serve and export must render prompts the way training did."""
    from transformers import AutoTokenizer

    from keel.data.template import CHATML_TEMPLATE

    out = tmp_path / "out"
    cfg = config(tiny_model_dir, data_file, out, "data.template=chatml", "train.max_steps=1")
    run_training(cfg, log=quiet)
    saved = AutoTokenizer.from_pretrained(out).chat_template
    assert saved == CHATML_TEMPLATE
    assert AutoTokenizer.from_pretrained(tiny_model_dir).chat_template != CHATML_TEMPLATE


def test_a_run_keeps_training_the_adapter_it_starts_from(tiny_model_dir, data_file, tmp_path):
    from safetensors.torch import load_file

    from keel.errors import ConfigError

    first = tmp_path / "sft"  # LoRA, and the (tied) output layer trained in full
    overrides = ("train.max_steps=3", "method.lora.modules_to_save=[lm_head]")
    run_training(config(tiny_model_dir, data_file, first, *overrides), log=quiet)
    start = load_file(first / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in start.items() if "lora_B" in k)  # trained
    assert "base_model.model.model.embed_tokens.weight" in start

    def one_tiny_step(out, *overrides):
        logs: list[str] = []
        cfg = config(
            tiny_model_dir, data_file, out, "train.max_steps=1", "train.lr=1e-12", *overrides
        )
        run_training(cfg, log=logs.append)
        return load_file(out / "adapter_model.safetensors"), logs

    kept, logs = one_tiny_step(tmp_path / "more", f"model.adapter={first}")
    assert kept.keys() == start.keys()
    for key, value in start.items():  # one step at lr 1e-12 leaves the start as it was
        torch.testing.assert_close(kept[key], value, atol=1e-9, rtol=0, msg=key)
    # negative control: without it the run starts from fresh adapters (B at zero)
    fresh, _ = one_tiny_step(tmp_path / "fresh")
    assert all(v.abs().max() < 1e-9 for k, v in fresh.items() if "lora_B" in k)
    with pytest.raises(ConfigError, match=r"method.lora.r = 8, but model.adapter = .* has r 4"):
        config(
            tiny_model_dir, data_file, tmp_path / "x", f"model.adapter={first}", "method.lora.r=8"
        )
    with pytest.raises(ConfigError, match=r"method.type = full; set method.type lora"):
        config(tiny_model_dir, data_file, tmp_path / "x", f"model.adapter={first}", method="full")
    with pytest.raises(ConfigError, match=r"no adapter_config.json or adapter_model.safetensors"):
        config(tiny_model_dir, data_file, tmp_path / "x", f"model.adapter={tmp_path}")


def test_a_dora_run_keeps_training_its_magnitudes(tiny_model_dir, data_file, tmp_path):
    """A DoRA adapter started from: its magnitudes come from its file (PEFT saves them
    without a parameter name), not from the base's norms; its config fixes dora."""
    from safetensors.torch import load_file

    from keel.errors import ConfigError

    first = tmp_path / "dora"
    run_training(
        config(tiny_model_dir, data_file, first, "train.max_steps=3", "method.lora.dora=true"),
        log=quiet,
    )
    start = load_file(first / "adapter_model.safetensors")
    magnitudes = [k for k in start if k.endswith(".lora_magnitude_vector")]
    assert magnitudes
    more = tmp_path / "more"
    steps = ("train.max_steps=1", "train.lr=1e-12", f"model.adapter={first}")
    run_training(config(tiny_model_dir, data_file, more, *steps), log=quiet)
    kept = load_file(more / "adapter_model.safetensors")
    assert kept.keys() == start.keys()
    for key in magnitudes:  # as the file holds them
        torch.testing.assert_close(kept[key], start[key], atol=1e-9, rtol=0, msg=key)
    with pytest.raises(ConfigError, match=r"method.lora.dora = False, but model.adapter"):
        config(
            tiny_model_dir,
            data_file,
            tmp_path / "x",
            f"model.adapter={first}",
            "method.lora.dora=false",
        )


@pytest.mark.parametrize(
    ("stage", "instead"),
    [
        (("train.stage=dpo",), "set dpo.reference: precompute"),
        (("train.stage=grpo", "grpo.rewards=[keel.rewards:format]", "grpo.beta=0.04"), "merge it"),
    ],
    ids=["dpo", "grpo"],
)
def test_a_live_reference_says_it_is_the_base_without_the_start_adapter(
    stage, instead, tiny_model_dir, data_file, tmp_path
):
    from keel.train.model_setup import _note_adapter_reference

    adapter = tmp_path / "adapter"  # the folder's files, as the config check reads them
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8})
    )
    (adapter / "adapter_model.safetensors").touch()
    cfg = config(
        tiny_model_dir,
        data_file,
        tmp_path / "out",
        f"model.adapter={adapter}",
        *stage,
    )
    logs: list[str] = []
    _note_adapter_reference(cfg, logs.append)
    (line,) = logs
    assert "the base with every adapter off, model.adapter's too" in line and instead in line
