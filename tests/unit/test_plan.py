"""`keel plan`: per-device memory of each strategy from config.json alone (field note 2)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from keel.cli import main
from keel.config import load_config
from keel.config.sizes import parse_memory
from keel.errors import ConfigError
from keel.plan import DeviceSpec, advice, decide, detect_devices, plan_run
from keel.plan.devices import GIB
from keel.precision import Precision

# Qwen2-72B's architecture as its config.json gives it; no weights anywhere.
QWEN2_72B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
}
SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def config_only_dir(root: Path, name: str, config: dict) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_yaml(root: Path, model_dir: Path, method: str = "full", **train) -> Path:
    cfg = {
        "model": {"path": str(model_dir)},
        "method": {"type": method},
        "data": {"datasets": ["never-read.json"], "cutoff_len": 2048},
        "train": train,
        "output": {"dir": str(root / "out")},
    }
    path = root / f"{model_dir.name}-{method}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def qwen72b_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan72b")
    model_dir = config_only_dir(root, "qwen2-72b", QWEN2_72B)
    cfg = load_config(run_yaml(root, model_dir))
    devices = detect_devices(gpus=8, memory="24GiB")
    return plan_run(cfg, devices=devices)


def test_field_note_2_full_replicas_do_not_fit_on_8x24gib(qwen72b_plan):
    plan = qwen72b_plan
    assert plan.params == plan.trainable_params == 72_706_203_648
    assert plan.devices.world == 8 and plan.devices.usable_bytes == int(0.9 * 24 * GIB)
    for strategy in ("ddp", "fsdp"):
        for checkpointing in (False, True):
            assert not plan.option_for(strategy, "full", checkpointing).fits
    # A full replica alone (fp32 weights, grads and two AdamW moments) is ~1 TiB.
    ddp = plan.option_for("ddp", "full", True).per_device
    assert ddp.params + ddp.grads + ddp.optimizer > 1000 * GIB
    # FSDP2 shards that 8 ways; still far too much for 24 GiB.
    assert plan.option_for("fsdp", "full", True).per_device.total > 100 * GIB
    rec = plan.recommendation
    assert rec is not None and rec.fits and rec.per_device.total <= plan.devices.usable_bytes
    # What fits: the state in host RAM (FSDP2 + CPU offload), activations checkpointed.
    assert (rec.strategy, rec.method, rec.gradient_checkpointing) == ("fsdp_offload", "full", True)
    assert rec.per_device.params == rec.per_device.grads == rec.per_device.optimizer == 0
    assert rec.host_bytes > 100 * GIB  # 16 bytes per parameter / 8 ranks, in host RAM
    assert plan.option_for("fsdp_offload", "lora", True).fits


def test_72b_advice_says_what_fits_and_what_it_costs(qwen72b_plan):
    lines = advice(qwen72b_plan)
    assert lines[0].startswith("recommendation: fsdp_offload + full + checkpointing")
    assert "distributed.fsdp.cpu_offload=true" in lines[0]
    assert "train.gradient_checkpointing=true" in lines[0]
    assert "GiB per node" in lines[0]  # offloaded state lives in host RAM
    # Without CPU offload only QLoRA fits (NF4 base weights, ~0.56 bytes per parameter)
    assert lines[1].startswith("without CPU offload: fsdp + qlora + checkpointing: ")
    assert "method.type=qlora" in lines[1]
    # Without QLoRA either, nothing fits without CPU offload: what would
    no_qlora = replace(
        qwen72b_plan, options=[o for o in qwen72b_plan.options if o.method != "qlora"]
    )
    lines = advice(no_qlora)
    assert lines[1] == "without CPU offload nothing fits here. What would:"
    more = [line for line in lines if "fsdp on " in line]
    assert more and more[0].endswith("GiB per device, fits") and "--nodes" in more[0]


def test_explicit_strategy_that_does_not_fit_is_refused_with_the_fix(tmp_path):
    model_dir = config_only_dir(tmp_path, "qwen2-72b", QWEN2_72B)
    cfg = load_config(run_yaml(tmp_path, model_dir), ["distributed.strategy=ddp"])
    decision = decide(plan_run(cfg, devices=detect_devices(gpus=8, memory="24GiB")))
    assert not decision.fits and decision.strategy == "ddp"
    assert (
        "the configured strategy ddp (full, gradient checkpointing off) needs" in decision.message
    )
    assert "of 21.6 GiB usable" in decision.message
    assert "the smallest change that fits: distributed.strategy=fsdp" in decision.message
    assert "distributed.plan=warn" in decision.message


def test_auto_strategy_takes_the_cheapest_that_fits(tmp_path):
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    cfg = load_config(run_yaml(tmp_path, model_dir, precision="fp32"))
    decision = decide(
        plan_run(cfg, devices=DeviceSpec(kind="cuda", per_node=2, memory_bytes=80 * GIB))
    )
    assert decision.fits and decision.strategy == "ddp"
    assert decision.message.startswith("plan: ddp + full needs")


def test_nothing_fits_says_what_would_with_numbers(tmp_path):
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    cfg = load_config(run_yaml(tmp_path, model_dir, micro_batch_size=8))
    plan = plan_run(cfg, devices=DeviceSpec(kind="cuda", per_node=1, memory_bytes=5 * GIB // 4))
    assert plan.recommendation is None and not any(o.fits for o in plan.options)
    text = "\n".join(advice(plan))
    assert text.startswith("nothing fits: every option needs more than 1.1 GiB per device")
    assert "train.micro_batch_size 8 -> " in text
    assert "data.cutoff_len 2048 -> " in text
    for line in text.splitlines()[2:]:
        assert line.endswith(("fits", "still does not fit")) and "GiB per device" in line


def test_plan_reads_no_weights(tmp_path, monkeypatch):
    """A folder with config.json and an unreadable weights file plans fine, and nothing
    opens a safetensors file or a tokenizer."""
    import keel.models.materialize as materialize

    model_dir = config_only_dir(tmp_path, "small", SMALL)
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")

    def refuse(*_args, **_kwargs):
        raise AssertionError("keel plan read the weights")

    monkeypatch.setattr(materialize.CheckpointReader, "__init__", refuse)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse)
    cfg = load_config(run_yaml(tmp_path, model_dir))
    plan = plan_run(cfg, devices=DeviceSpec(kind="cpu", per_node=1, memory_bytes=64 * GIB))
    attention = 2 * 256 * 256 + 2 * 128 * 256  # q, o; k, v (4 kv heads of 32)
    assert plan.params == 8192 * 256 + 4 * (attention + 3 * 256 * 704 + 2 * 256) + 256


def test_json_is_one_document_on_stdout(tmp_path, capsys):
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    config = run_yaml(tmp_path, model_dir, method="lora")
    assert (
        main(
            [
                "plan",
                str(config),
                "train.micro_batch_size=2",
                "--gpus",
                "4",
                "--nodes",
                "2",
                "--gpu-memory",
                "24GiB",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    doc = json.loads(out)  # the whole of stdout, nothing before or after
    assert set(doc) == {"model", "devices", "options", "recommendation"}
    assert doc["devices"] == {
        "count": 8,
        "memory_bytes": 24 * GIB,
        "kind": "cuda",
        "tensor_parallel": 1,
    }
    assert doc["model"]["trainable_params"] < doc["model"]["params"]
    keys = {"params", "grads", "optimizer", "activations", "logits", "buffers", "overhead", "total"}
    keys.add("generation")  # 0 unless the stage generates (grpo)
    seen = set()
    for option in doc["options"]:
        assert set(option) == {
            "strategy",
            "method",
            "gradient_checkpointing",
            "per_device_bytes",
            "host_bytes",
            "fits",
        }
        assert set(option["per_device_bytes"]) == keys
        assert all(isinstance(v, int) for v in option["per_device_bytes"].values())
        seen.add((option["strategy"], option["method"], option["gradient_checkpointing"]))
    assert seen == {
        (s, m, c)
        for s in ("ddp", "fsdp", "fsdp_offload")
        for m in ("full", "lora", "freeze", "qlora")
        for c in (False, True, "offload")  # offloaded checkpointing: weighed on GPUs
    }
    assert doc["recommendation"] in doc["options"]
    assert doc["recommendation"]["method"] == "lora"


def test_plan_prints_a_table_and_a_recommendation(tmp_path, capsys):
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    assert main(["plan", str(run_yaml(tmp_path, model_dir)), "--gpu-memory", "16GiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:4] == ["strategy", "method", "ckpt", "params"]
    assert out[3].split()[:3] == ["single", "full", "off"]
    assert out[-1].startswith("recommendation: single + full")


@pytest.mark.parametrize(
    "text,size",
    [
        ("24GiB", 24 * GIB),
        ("80GB", 80 * 10**9),
        ("24g", 24 * GIB),
        ("512 MiB", 512 * 2**20),
        ("1.5GiB", 3 * GIB // 2),
        ("1000", 1000),
        (2**30, GIB),
    ],
)
def test_memory_sizes(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "24 parsecs", "-1GiB", "0", "GiB", "1e9"])
def test_bad_memory_sizes_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="24GiB, 80GB, 24g"):
        parse_memory(text)


def test_device_memory_key_is_validated_and_used(tmp_path):
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    config = run_yaml(tmp_path, model_dir)
    with pytest.raises(ConfigError, match="distributed.device_memory = 'lots' is not a memory"):
        load_config(config, ["distributed.device_memory=lots"])
    with pytest.raises(ConfigError, match="distributed.plan"):
        load_config(config, ["distributed.plan=maybe"])
    cfg = load_config(config, ["distributed.device_memory=16GiB", "distributed.plan=warn"])
    assert cfg.distributed.plan == "warn"
    devices = detect_devices(config_memory=cfg.distributed.device_memory)
    assert devices.memory_bytes == 16 * GIB
    assert detect_devices(memory="8GiB", config_memory="16GiB").memory_bytes == 8 * GIB


def test_gpus_without_memory_on_a_cpu_machine_is_a_user_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices to measure")
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    assert main(["plan", str(run_yaml(tmp_path, model_dir)), "--gpus", "8"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err


def test_bf16_frozen_weights_what_if_matches_a_real_bf16_build(tmp_path):
    from keel.config.schema import MethodConfig
    from keel.plan.architecture import build_meta_model, read_architecture
    from keel.plan.census import take_census

    model_dir = config_only_dir(tmp_path, "small", SMALL)
    cfg = load_config(run_yaml(tmp_path, model_dir, method="lora"))
    arch = read_architecture(cfg)
    import torch

    fp32_compute = Precision("fp32", "test")
    fp32 = take_census(
        build_meta_model(arch, dtype=torch.float32), MethodConfig(), precision=fp32_compute
    )
    bf16 = take_census(
        build_meta_model(arch, dtype=torch.bfloat16), MethodConfig(), precision=fp32_compute
    )
    assert fp32.with_frozen_itemsize(2) == bf16


def test_preference_stages_plan_pairs_and_the_reference_copy(tmp_path):
    """A DPO row is two sequences; full DPO with a live reference holds a second copy of the
    weights, LoRA does not (its reference is the base with adapters off), precompute not."""
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    devices = detect_devices(gpus=1, memory="24GiB")

    def option(method: str, *overrides: str):
        cfg = load_config(run_yaml(tmp_path, model_dir, method), list(overrides))
        return plan_run(cfg, devices=devices).option_for("single", method, False).per_device

    sft, dpo = option("full"), option("full", "train.stage=dpo")
    assert dpo.params == 2 * sft.params and dpo.grads == sft.grads
    assert dpo.activations > 1.9 * sft.activations  # twice the tokens per row
    precomputed = option("full", "train.stage=dpo", "dpo.reference=precompute")
    assert precomputed.params == sft.params
    assert option("lora", "train.stage=dpo").params == option("lora").params
    kto = option("full", "train.stage=kto")
    assert kto.params == 2 * sft.params and kto.activations == sft.activations


def test_dora_plans_its_magnitudes_activations_and_its_moment_in_forward(tmp_path):
    """DoRA over LoRA: a magnitude per output feature of each adapted layer, two more saved
    outputs per token and layer, and PEFT's moment in forward that builds LoRA's weight from
    an identity matrix (down_proj reads 704 features: a 704^2 fp32 identity)."""
    import torch

    from keel.plan.adapter_memory import dora_transient_bytes
    from keel.plan.architecture import build_meta_model, read_architecture
    from keel.plan.census import take_census

    model_dir = config_only_dir(tmp_path, "small", SMALL)
    path = run_yaml(tmp_path, model_dir, method="lora", precision="fp32")
    plans = {
        dora: plan_run(
            load_config(path, [f"method.lora.dora={dora}"]),
            devices=detect_devices(gpus=1, memory="80GiB"),
        )
        for dora in (False, True)
    }
    lora, dora = (plans[d].option_for("single", "lora", False).per_device for d in (False, True))
    layer_outputs = 256 + 128 + 128 + 256 + 704 + 704 + 256  # q k v o gate up down
    assert plans[True].trainable_params - plans[False].trainable_params == 4 * layer_outputs
    assert dora.activations > lora.activations
    cfg = load_config(path, ["method.lora.dora=true"])
    meta = build_meta_model(read_architecture(cfg), dtype=torch.float32)
    census = take_census(meta, cfg.method, precision=Precision("bf16", "test"))
    moment = dora_transient_bytes(census)
    assert moment == 4 * 704**2 + 3 * 4 * 704 * 256
    assert dora.total >= lora.total - lora.logits + moment


def test_context_parallel_plans_a_part_of_each_row(tmp_path):
    """distributed.context_parallel 4: each process computes a quarter of a micro-batch's
    tokens (activations and logits), and shards the weights over every process."""
    model_dir = config_only_dir(tmp_path, "small", SMALL)
    devices = detect_devices(gpus=8, memory="24GiB")

    def option(*overrides: str):
        cfg = load_config(run_yaml(tmp_path, model_dir, "full"), list(overrides))
        return plan_run(cfg, devices=devices).option_for("fsdp", "full", False).per_device

    whole, split = option(), option("distributed.context_parallel=4")
    assert split.activations * 4 == pytest.approx(whole.activations, rel=0.01)
    assert split.logits < whole.logits
    assert (split.params, split.grads, split.optimizer) == (
        whole.params,
        whole.grads,
        whole.optimizer,
    )
    cfg = load_config(run_yaml(tmp_path, model_dir), ["distributed.context_parallel=4"])
    assert "tokens split over 4 processes" in decide(plan_run(cfg, devices=devices)).message
