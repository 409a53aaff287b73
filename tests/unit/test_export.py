"""keel export: merged LoRA == base + adapter, a plain HF folder, every source keel writes
(adapter, output.dir, checkpoint of a one-process and of an FSDP run), and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from safetensors import safe_open

from keel.cli import main
from keel.config import load_config
from keel.config.schema import LoraConfig, MethodConfig
from keel.errors import CheckpointError, ModelError
from keel.export import ExportRequest, export_model
from keel.models.adapters import apply_method, load_for_inference, save_model_dir
from keel.models.loading import load_model, load_tokenizer

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 61, 140]])  # [1, T]
MERGE_TOL = 1e-5  # fp32 on both sides
VOCAB = 320  # the tiny tokenizer's (tests/conftest.py)
LORA = MethodConfig(type="lora", lora=LoraConfig(r=4, alpha=8.0, dropout=0.0))


def quiet(_message):
    pass


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # [1, T, V]


def plain_logits(folder) -> torch.Tensor:
    """Logits of the folder loaded by transformers alone, in fp32."""
    from transformers import AutoModelForCausalLM

    return logits(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval())


def export(base, out, adapter=None, **options):
    return export_model(
        ExportRequest(model=str(base), adapter=adapter and str(adapter), out=out, **options),
        log=quiet,
    )


def randomize_lora(model, seed: int = 0) -> None:
    # PEFT starts lora_B at zero (a no-op adapter); a merge test needs a real delta.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def save_base(folder, model=None):
    """A base model folder: `model` (default: a 3-layer tiny Llama) and the tiny tokenizer."""
    tokenizer = build_tiny_tokenizer()
    (model or build_tiny_model(VOCAB, layers=3)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_adapter(base_dir, out, method=LORA):
    model = apply_method(load_model(base_dir, dtype=torch.float32), method, log=quiet)
    randomize_lora(model)
    save_model_dir(model, load_tokenizer(base_dir), out)
    return out


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return save_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "adapter")


@pytest.fixture(scope="module")
def exported(tiny_model_dir, adapter_dir, tmp_path_factory):
    return export(tiny_model_dir, tmp_path_factory.mktemp("export") / "merged", adapter_dir)


def test_merged_model_matches_base_plus_adapter(tiny_model_dir, adapter_dir, exported):
    unmerged, _ = load_for_inference(
        str(tiny_model_dir), str(adapter_dir), cache_dir="unused", log=quiet
    )
    want = logits(unmerged)
    got = plain_logits(exported)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| merged vs base+adapter: {diff:.2e}")
    assert diff < MERGE_TOL
    # Negative control: the adapter matters, so a merge that dropped it would fail above.
    assert (plain_logits(tiny_model_dir) - want).abs().max().item() > 100 * MERGE_TOL


def test_export_is_a_plain_hugging_face_folder(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(name.startswith("adapter") for name in names), names
    assert not list(exported.parent.glob(".*partial*"))  # the temporary folder was renamed
    # transformers writes safetensors private (0600); a served model is read by other users.
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in exported.iterdir())
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    assert tokenizer.chat_template == build_tiny_tokenizer().chat_template
    config = json.loads((exported / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32"  # the base's
    model = AutoModelForCausalLM.from_pretrained(str(exported))
    assert type(model).__name__ == "LlamaForCausalLM"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
    eos = json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ([eos] if isinstance(eos, int) else eos)


def test_cli_writes_bfloat16_shards(tiny_model_dir, adapter_dir, exported, tmp_path, capsys):
    out = tmp_path / "bf16"
    args = ["export", "--model", str(tiny_model_dir), "--adapter", str(adapter_dir)]
    assert main([*args, "--out", str(out), "--dtype", "bfloat16", "--max-shard-size", "8KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / shard).is_file() for shard in shards)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    with safe_open(str(exported / "model.safetensors"), framework="pt") as fp32:
        for shard in shards:
            with safe_open(str(out / shard), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118
                    tensor = handle.get_tensor(key)
                    assert tensor.dtype == torch.bfloat16, key
                    # The fp32 merge, rounded once.
                    assert torch.equal(tensor, fp32.get_tensor(key).to(torch.bfloat16)), key
    assert (plain_logits(out) - plain_logits(exported)).abs().max().item() < 0.05


def test_default_dtype_is_the_base_models(tmp_path):
    base = save_base(tmp_path / "bf16-base", build_tiny_model(VOCAB).to(torch.bfloat16))
    out = export(base, tmp_path / "out", save_adapter(base, tmp_path / "adapter"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}  # noqa: SIM118


def test_lora_on_tied_embeddings_is_merged_untied(tiny_model_dir, tmp_path):
    """The output layer shares the embedding matrix; the adapter changes only the lookup."""
    method = MethodConfig(type="lora", lora=LoraConfig(r=4, targets=["embed_tokens", "q_proj"]))
    adapter = save_adapter(tiny_model_dir, tmp_path / "adapter", method)
    out = export(tiny_model_dir, tmp_path / "out", adapter)
    unmerged, _ = load_for_inference(str(tiny_model_dir), str(adapter), cache_dir="x", log=quiet)
    assert (plain_logits(out) - logits(unmerged)).abs().max().item() < MERGE_TOL
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_non_empty_out_is_refused_and_left_alone(tiny_model_dir, adapter_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["export", "--model", str(tiny_model_dir), "--adapter", str(adapter_dir)]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder either


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype", "float8"], "--dtype float8: not a dtype keel exports"),
        (["--model", "/nonexistent/base"], "does not exist"),
        (["--adapter", "/nonexistent/adapter"], "no such folder"),
    ],
)
def test_user_errors_exit_2(tiny_model_dir, adapter_dir, tmp_path, capsys, flags, message):
    given = {"--model": str(tiny_model_dir), "--adapter": str(adapter_dir)}
    given.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    args = [word for pair in given.items() for word in pair]
    assert main(["export", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_adapter_of_another_base_is_refused(tiny_model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    deeper = save_base(tmp_path / "deeper")
    with pytest.raises(ModelError, match="match no module of the base"):
        export(tiny_model_dir, tmp_path / "a", save_adapter(deeper, tmp_path / "deep-adapter"))
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    wider = save_base(tmp_path / "wider", LlamaForCausalLM(config))
    with pytest.raises(ModelError, match="does not fit the base model"):
        export(tiny_model_dir, tmp_path / "b", save_adapter(wider, tmp_path / "wide-adapter"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- what `keel train` writes: output.dir and checkpoints/step-N ---------------------------


def train(model_dir, tmp_path, method: str):
    from keel.train.run import run_training

    data = tmp_path / "qa.json"
    rows = [
        {"instruction": f"Question {i}?", "input": "", "output": f"Answer {i}."} for i in range(8)
    ]
    data.write_text(json.dumps(rows))
    out = tmp_path / f"run-{method}"
    base = {
        "model": {"path": str(model_dir), "cache_dir": str(tmp_path / "cache")},
        "method": {"type": method, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data)], "cutoff_len": 64, "val_size": 0},
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": 5e-2, "precision": "fp32"},
        "output": {"dir": str(out), "save_every": 1, "keep_last": 2},
    }
    base["train"]["threads"] = 1
    run_training(load_config(None, [], base=base), log=quiet)
    return out


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def assert_same_weights(a, b):
    first, second = tensors(a), tensors(b)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_adapter_run_exports_from_its_output_dir_and_checkpoints(tiny_model_dir, tmp_path, method):
    run = train(tiny_model_dir, tmp_path, method)
    step2 = run / "checkpoints" / "step-00000002"
    from_output = export(run, tmp_path / "from-output")  # its final adapter
    from_checkpoint = export(run / "checkpoints" / "step-00000002", tmp_path / "from-ckpt")
    with_base = export(tiny_model_dir, tmp_path / "with-base", adapter=step2)
    unmerged, _ = load_for_inference(str(run), None, cache_dir="unused", log=quiet)
    want = logits(unmerged)
    assert (plain_logits(from_output) - want).abs().max().item() < MERGE_TOL
    assert (plain_logits(tiny_model_dir) - want).abs().max().item() > 100 * MERGE_TOL
    # The last checkpoint holds the final adapter's weights, so the exports are identical.
    assert_same_weights(from_checkpoint, from_output)
    assert_same_weights(with_base, from_output)
    step1 = export(run / "checkpoints" / "step-00000001", tmp_path / "step1")
    assert (plain_logits(step1) - want).abs().max().item() > 100 * MERGE_TOL


@pytest.mark.parametrize("method", ["full", "freeze"])
def test_full_and_freeze_runs_export_from_a_checkpoint(tiny_model_dir, tmp_path, method):
    run = train(tiny_model_dir, tmp_path, method)
    from_checkpoint = export(run / "checkpoints" / "step-00000002", tmp_path / "from-ckpt")
    assert_same_weights(from_checkpoint, run)  # the run's final model, rebuilt from the shards
    assert (plain_logits(from_checkpoint) - plain_logits(tiny_model_dir)).abs().max() > 1e-3


def test_unfinished_or_broken_sources_name_the_fix(tiny_model_dir, tmp_path):
    run = train(tiny_model_dir, tmp_path, "lora")
    for name in ("adapter_config.json", "adapter_model.safetensors", "keel_run.json"):
        (run / name).unlink()  # as if the run had died after its last checkpoint
    newest = run / "checkpoints" / "step-00000002"
    with pytest.raises(CheckpointError, match=f"has not finished.*--model {newest}"):
        export(run, tmp_path / "a")
    with pytest.raises(CheckpointError, match="holds checkpoints"):
        export(run / "checkpoints", tmp_path / "b")
    partial = run / "checkpoints" / ".tmp-step-00000003"
    partial.mkdir()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        export(partial, tmp_path / "c")
    with pytest.raises(ModelError, match="cannot take --adapter"):
        export(newest, tmp_path / "d", adapter=newest)
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(CheckpointError, match="format 1; this keel exports format 2"):
        export(newest, tmp_path / "e")
    step1 = run / "checkpoints" / "step-00000001"
    other = save_base(tmp_path / "other-base")
    with pytest.raises(ModelError, match="does not fit the base model.*not in the checkpoint"):
        export(other, tmp_path / "f", adapter=step1)  # a 3-layer base: layer 2 has no weights
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_fsdp_checkpoint_exports_like_the_unmerged_adapter(tiny_model_dir, tmp_path):
    """An FSDP2 run saves DTensor shards; a 1-rank mesh saves them the way 2+ ranks do."""
    import torch.distributed as dist

    from keel.checkpoint.checkpointer import Checkpointer, StatefulParts
    from keel.checkpoint.identity import run_identity
    from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
    from keel.distributed.parallel_dims import ParallelDims
    from keel.distributed.process_group import DistContext
    from keel.distributed.strategy import Strategy
    from keel.precision import Precision
    from keel.train.model_setup import build_training_model

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    cfg = RunConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "run")),
        method=LORA,
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = DistContext(dims=ParallelDims.for_strategy(Strategy.FSDP, 1).build_mesh("cpu"))
        built = build_training_model(
            cfg, tiny_model_dir, ctx, Precision("fp32", "test"), quiet, strategy="fsdp"
        )
        lora = {n: p for n, p in built.model.named_parameters() if "lora_" in n}
        assert type(next(iter(lora.values()))).__name__ == "DTensor"
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in lora.values():
                param.to_local().copy_(torch.randn(param.shape, generator=generator) * 0.2)
        values = {n: p.full_tensor().clone() for n, p in lora.items()}
        optimizer = torch.optim.AdamW([p for p in built.objective.parameters() if p.requires_grad])
        identity = run_identity(cfg, tiny_model_dir, Precision("fp32", "test"), "test-data")
        meta = {"global_batch": 1, **identity.to_meta()}
        parts = StatefulParts(
            module=built.objective,
            optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0),
        )
        checkpointer = Checkpointer(parts, output_dir=tmp_path / "run", keep_last=1, dist=ctx)
        checkpoint = checkpointer.save(1, meta)
    finally:
        dist.destroy_process_group()
    out = export(checkpoint, tmp_path / "out")
    reference = apply_method(load_model(tiny_model_dir, dtype=torch.float32), LORA, log=quiet)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_" in name:
                param.copy_(values[name])
    diff = (plain_logits(out) - logits(reference.eval())).abs().max().item()
    assert diff < MERGE_TOL


def test_legacy_keys_say_what_the_new_ones_say(tmp_path):
    """transformers 4.x reads rope_theta/rope_scaling and torch_dtype; without them it would
    run with its default rope_theta. The 5.x reading must not change."""
    from transformers import AutoConfig, LlamaConfig

    from keel.export.hf_compat import add_legacy_keys

    rope = {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, rope_parameters=rope)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    before = AutoConfig.from_pretrained(str(tmp_path)).to_dict()
    assert "rope_theta" not in json.loads((tmp_path / "config.json").read_text())
    add_legacy_keys(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    after = AutoConfig.from_pretrained(str(tmp_path)).to_dict()
    assert after["rope_parameters"] == before["rope_parameters"] == rope
