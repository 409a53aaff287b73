"""LLaMA-Factory configs as they ship: every key gets a fate, and the translation is a keel
config that keel's own loader accepts (training them is tests/e2e/test_dialects_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from config_support import model_type_folder

from keel.config import load_config
from keel.config.dialects import KeyFate, detect_dialect, refusal_problems, translate
from keel.config.dialects.llamafactory import translate_llamafactory
from keel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/dialects/llamafactory"
FIXTURE_FILES = sorted(FIXTURES.glob("*.yaml"))


def _their_config(name: str, tmp_path: Path) -> tuple[dict, Path]:
    """The fixture with its placeholders filled, and where it was written."""
    text = (FIXTURES / name).read_text(encoding="utf-8")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    text = text.replace("{model}", "bundled:smollm2-135m-instruct").replace("{data}", str(data))
    path = FIXTURES / name  # their relative paths (the DeepSpeed JSON) sit next to it
    return yaml.safe_load(text.replace("{dataset}", "alpaca_mini,chat_mini")), path


def test_fixtures_are_their_examples():
    assert len(FIXTURE_FILES) == 9
    assert (FIXTURES / "examples/deepspeed/ds_z3_config.json").is_file()


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.stem)
def test_each_fixture_translates_and_keel_loads_it(path: Path, tmp_path: Path):
    raw, source = _their_config(path.name, tmp_path)
    assert detect_dialect(raw) == "llamafactory"
    translation = translate(raw, source)
    assert translation.refused() == []
    assert {fate.key for fate in translation.fates} >= {str(key) for key in raw}
    written = tmp_path / "keel.yaml"
    written.write_text(yaml.safe_dump(translation.config), encoding="utf-8")
    cfg = load_config(written)
    assert cfg.model.path == "bundled:smollm2-135m-instruct"
    assert [d.path for d in cfg.data.datasets] == ["alpaca_mini", "chat_mini"]
    report = translation.report()
    for fate in translation.fates:
        assert fate.key in report


def test_golden_mapping_of_the_lora_dpo_example(tmp_path: Path):
    raw, source = _their_config("qwen3_lora_dpo.yaml", tmp_path)
    raw["pref_loss"] = "simpo"  # their comment offers it: dpo + simpo is keel's simpo stage
    translation = translate(raw, source)
    fates = {fate.key: fate for fate in translation.fates}
    mapped = {key: f.target for key, f in fates.items() if f.fate == "mapped"}
    assert mapped == {
        "model_name_or_path": "model.path",
        "trust_remote_code": "model.trust_remote_code",
        "stage": "train.stage",
        "finetuning_type": "method.type",
        "lora_rank": "method.lora.r",
        "lora_target": "method.lora.targets",
        "pref_beta": "simpo.beta",
        "pref_loss": "train.stage",
        "dataset": "data.datasets",
        "dataset_dir": "data.dataset_dir",
        "template": "data.template",
        "cutoff_len": "data.cutoff_len",
        "max_samples": "data.datasets.*.max_samples",
        "preprocessing_num_workers": "data.num_proc",
        "output_dir": "output.dir",
        "logging_steps": "output.log_every",
        "save_steps": "output.save_every",
        "overwrite_output_dir": "output.overwrite",
        "report_to": "output.loggers",
        "per_device_train_batch_size": "train.micro_batch_size",
        "gradient_accumulation_steps": "train.grad_accum",
        "learning_rate": "train.lr",
        "num_train_epochs": "train.epochs",
        "lr_scheduler_type": "train.scheduler",
        "warmup_ratio": "train.warmup_ratio",
        "bf16": "train.precision",
        "resume_from_checkpoint": "train.resume",
    }
    ignored = {key for key, f in fates.items() if f.fate == "ignored"}
    assert ignored == {
        "do_train",
        "dataloader_num_workers",
        "plot_loss",
        "save_only_model",
        "ddp_timeout",
    }
    assert "watchdog.hang_timeout_s" in fates["ddp_timeout"].why
    assert translation.refused() == []
    data = tmp_path / "data"
    assert translation.config == {
        "model": {"path": "bundled:smollm2-135m-instruct", "trust_remote_code": True},
        "train": {
            "stage": "simpo",
            "micro_batch_size": 1,
            "grad_accum": 8,
            "lr": 5.0e-6,
            "epochs": 3.0,
            "scheduler": "cosine",
            "warmup_ratio": 0.1,
            "precision": "bf16",
            "resume": "auto",
            "gradient_checkpointing": True,
        },
        "method": {
            "type": "lora",
            "lora": {"r": 8, "targets": "all-linear", "alpha": 16, "dropout": 0.0},
        },
        "simpo": {"beta": 0.1},
        "data": {
            "dataset_dir": str(data),
            "template": "auto",
            "cutoff_len": 2048,
            "num_proc": 16,
            "datasets": [
                {"path": "alpaca_mini", "max_samples": 1000},
                {"path": "chat_mini", "max_samples": 1000},
            ],
        },
        "output": {
            "dir": "saves/qwen3-4b/lora/dpo",
            "log_every": 10,
            "save_every": 500,
            "overwrite": True,
            "loggers": ["jsonl"],
        },
    }
    assert translation.notes == [
        "method.lora.alpha = 16: 2 x lora_rank, their default",
        "method.lora.dropout = 0.0: lora_dropout's default",
        "train.gradient_checkpointing = True: on unless disabled",
    ]


def test_deepspeed_zero3_becomes_fsdp_and_qlora_the_4bit_base(tmp_path: Path):
    raw, source = _their_config("qwen3_full_sft.yaml", tmp_path)
    config = translate(raw, source).config
    assert config["distributed"] == {"strategy": "fsdp"}
    assert config["method"] == {"type": "full"}
    raw, source = _their_config("qwen3_lora_sft_otfq.yaml", tmp_path)
    config = translate(raw, source).config
    assert config["method"]["type"] == "qlora"
    assert config["method"]["qlora"] == {"quant": "nf4"}


@pytest.mark.parametrize(
    ("stage", "pref_loss", "keel_stage"),
    [("pt", None, "pt"), ("rm", None, "rm"), ("kto", None, "kto"), ("dpo", "orpo", "orpo")],
)
def test_stages(stage, pref_loss, keel_stage, tmp_path: Path):
    raw, source = _their_config("qwen3_lora_sft.yaml", tmp_path)
    raw.update(stage=stage, pref_beta=0.2)
    if pref_loss:
        raw["pref_loss"] = pref_loss
    translation = translate(raw, source)
    assert translation.config["train"]["stage"] == keel_stage
    beta = {f.key: f for f in translation.fates}["pref_beta"]
    if keel_stage in ("kto", "orpo"):
        assert translation.config[keel_stage] == {"beta": 0.2}
    else:
        assert beta.fate == "ignored" and keel_stage not in translation.config
    assert translation.config["data"].get("packing") is (True if stage == "pt" else None)
    assert translation.config["data"].get("overlength") == ("split" if stage == "pt" else None)


@pytest.mark.parametrize(
    ("packing", "overlength"),
    [
        ({"packing": None}, "split"),
        ({"neat_packing": True}, "split"),
        ({"packing": False}, "truncate"),
    ],
)
def test_pretraining_cuts_or_truncates_long_text_as_they_do(packing, overlength, tmp_path: Path):
    # packed, their pt joins the texts and cuts them into cutoff_len blocks; unpacked it
    # truncates each text
    raw, source = _their_config("qwen3_lora_sft.yaml", tmp_path)
    raw.update(stage="pt", **packing)
    data = translate(raw, source).config["data"]
    assert data["overlength"] == overlength
    assert data.get("packing", False) is (overlength == "split")


def test_offload_and_zero2(tmp_path: Path):
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    raw = {"model_name_or_path": "m", "do_train": True, "deepspeed": {"zero_optimization": zero}}
    config = translate(raw, tmp_path / "x.yaml").config
    assert config["distributed"] == {"strategy": "fsdp", "fsdp": {"cpu_offload": True}}
    raw["deepspeed"] = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.config["distributed"] == {"strategy": "ddp"}
    assert [f.key for f in translation.refused()] == ["deepspeed.optimizer.type"]


def test_deepspeed_autotp_is_tensor_parallelism_under_fsdp(tmp_path: Path):
    """Their examples/deepspeed/ds_z2_autotp_config.json: ZeRO-2 with AutoTP over 2."""
    autotp = {
        "_comment": "supported model list: ...", "train_batch_size": "auto",
        "zero_optimization": {"stage": 2, "overlap_comm": False},
        "tensor_parallel": {"autotp_size": 2},
    }  # fmt: skip
    raw = {"model_name_or_path": "m", "do_train": True, "deepspeed": autotp}
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.config["distributed"] == {"strategy": "fsdp", "tensor_parallel": 2}
    fates = {f.key: f for f in translation.fates}
    assert "ZeRO-2 beside AutoTP" in fates["deepspeed.zero_optimization.stage"].why
    assert fates["deepspeed.tensor_parallel.autotp_size"].fate == "mapped"
    assert translation.refused() == []
    raw["deepspeed"] = {**autotp, "tensor_parallel": {"autotp_size": 1}}
    assert translate(raw, tmp_path / "x.yaml").config["distributed"] == {"strategy": "ddp"}


def test_unknown_and_unsupported_keys_are_refused_with_why(tmp_path: Path):
    raw = {
        "model_name_or_path": "m",
        "do_train": True,
        "stage": "ppo",
        "quantization_bit": 8,
        "template": "alpaca",
        "lr_scheduler_type": "polynomial",
        "use_galore": True,
        "report_to": "mlflow",
        "deepspeed": "missing.json",
        "not_a_key": 1,
    }
    translation = translate(raw, tmp_path / "their.yaml")
    refused = {f.key: f.why for f in translation.refused()}
    assert set(refused) == set(raw) - {"model_name_or_path", "do_train"}
    assert "grpo" in refused["stage"]
    assert "generic prompt format" in refused["template"]
    problems = refusal_problems(translation)
    assert len(problems) == len(refused)
    assert all("(LLaMA-Factory) is refused: " in problem for problem in problems)


@pytest.mark.parametrize(
    ("key", "value", "fate", "shuffle"),
    [
        ("disable_shuffling", True, "mapped", False),  # their trainer reads rows in order
        ("disable_shuffling", False, "ignored", None),
        ("eval_on_each_dataset", True, "ignored", None),  # a logging difference only
        ("enable_thinking", True, "ignored", None),  # their default
        ("enable_thinking", False, "refused", None),  # strips the reasoning keel trains
        # video sampling (their MOSS-VL examples set it beside image data): keel refuses a
        # row with a video when it reads it, so for image data it asks for nothing
        ("video_fps", 1.0, "ignored", None),
        ("video_maxlen", 256, "ignored", None),
    ],
)
def test_their_data_switches(key, value, fate, shuffle, tmp_path: Path):
    raw = {"model_name_or_path": "m", "do_train": True, "stage": "sft", key: value}
    translation = translate(raw, tmp_path / "their.yaml")
    assert {f.key: f.fate for f in translation.fates}[key] == fate
    assert translation.config.get("data", {}).get("shuffle") == shuffle


def test_their_settings_at_their_defaults_are_ignored_as_their_webui_writes_them(tmp_path):
    """LlamaBoard saves many of their settings at default values; those ask for nothing keel
    does differently. The same keys set otherwise are refused, naming their default."""
    webui = {
        "model_name_or_path": "m", "do_train": True, "stage": "sft", "template": "qwen3",
        "flash_attn": "auto", "preprocessing_batch_size": 1000, "use_fast_tokenizer": True,
        "upcast_layernorm": False, "default_system": None, "preserve_thinking": False,
        "include_num_input_tokens_seen": True, "plot_loss": True, "enable_thinking": True,
    }  # fmt: skip
    translation = translate(webui, tmp_path / "their.yaml")
    assert translation.refused() == []
    changed = translate({**webui, "upcast_layernorm": True}, tmp_path / "their.yaml")
    (refused,) = changed.refused()
    assert refused.key == "upcast_layernorm" and "their default, False" in refused.why
    galore = translate({**webui, "galore_rank": 16}, tmp_path / "x.yaml")  # default: ignored
    assert galore.refused() == []


def test_a_typo_is_refused_naming_the_key_it_resembles(tmp_path: Path):
    raw = {"model_name_or_path": "m", "do_train": True, "lora_rnak": 8, "learning_rat": 1e-4}
    zero = {"stage": 3, "offlod_param": {"device": "cpu"}}
    raw["deepspeed"] = {"zero_optimization": zero, "made_up": 1}
    refused = {f.key: f.why for f in translate(raw, tmp_path / "x.yaml").refused()}
    assert refused["lora_rnak"].endswith("did you mean `lora_rank`?")
    assert refused["learning_rat"].endswith("did you mean `learning_rate`?")
    offload = refused["deepspeed.zero_optimization.offlod_param.device"]
    assert offload.endswith("did you mean `zero_optimization.offload_param`?")
    assert refused["deepspeed.made_up"].endswith("remove it from the JSON")


def test_without_do_train_their_run_trains_nothing_so_keel_refuses(tmp_path: Path):
    translation = translate({"model_name_or_path": "m"}, tmp_path / "x.yaml")
    (refused,) = translation.refused()
    assert refused.key == "do_train" and "add `do_train: true`" in refused.why
    assert translation.config["output"]["dir"] == "trainer_output"  # HF's default output_dir
    assert "output.dir = trainer_output: HF's default" in translation.notes


# Keys of the DeepSpeed files they ship beyond the ZeRO-3 fixture's (Axolotl's
# deepspeed_configs/, LLaMA-Factory's examples/deepspeed/): diagnostics, compile, ZeRO-3
# knobs without their stage3_ prefix, the CPU optimizer switch
SHIPPED_DEEPSPEED = {
    "zero1": {
        "zero_optimization": {"stage": 1, "overlap_comm": True},
        "compile": {"disable": False, "backend": "inductor"},
        "wall_clock_breakdown": False,
    },
    "zero3_bf16_cpuoffload_all": {
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "max_live_parameters": 0,
            "max_reuse_distance": 0,
            "gather_16bit_weights_on_model_save": True,
        },
    },
    "ds_z3_fp8_config": {
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10,
        "comms_config": {"verbose": False},
        "monitor_config": {"enabled": True, "csv_monitor": {"enabled": True}},
    },
}


@pytest.mark.parametrize("name", sorted(SHIPPED_DEEPSPEED))
def test_the_deepspeed_files_they_ship_read_without_refusal(name, tmp_path: Path):
    raw = {"model_name_or_path": "m", "do_train": True, "deepspeed": SHIPPED_DEEPSPEED[name]}
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.refused() == []
    strategy = "ddp" if name == "zero1" else "fsdp"
    assert translation.config["distributed"]["strategy"] == strategy


def test_templates():
    fate = translate({"model_name_or_path": "m", "template": "chatml"}, Path("x.yaml"))
    assert fate.config["data"]["template"] == "chatml"
    fate = translate({"model_name_or_path": "m", "template": "llama3"}, Path("x.yaml"))
    assert fate.config["data"]["template"] == "auto"
    assert "llama3" in {f.key: f for f in fate.fates}["template"].why


@pytest.mark.parametrize(
    ("template", "model_type"),
    [("qwen3", "llama"), ("llama3", "qwen2"), ("qwen", "qwen3"), ("gemma3", "gemma3n")],
)
def test_a_family_template_on_a_model_of_another_family_is_refused(template, model_type, tmp_path):
    # LLaMA-Factory renders its template whatever the model; keel renders the model's own,
    # so the two differ here: refused, naming the template, the model's type and the fix
    model = model_type_folder(tmp_path, model_type)
    raw = {"model_name_or_path": str(model), "do_train": True, "template": template}
    translation = translate(raw, tmp_path / "x.yaml")
    (refused,) = translation.refused()
    assert refused.key == "template"
    assert refused.why.startswith(f"{template} is the ")
    assert f"model_name_or_path {model} is a {model_type} model" in refused.why
    assert "leave template out" in refused.why and ".jinja" in refused.why
    assert "template" not in translation.config.get("data", {})


def test_the_refusal_names_the_templates_of_the_models_family(tmp_path):
    raw = {"model_name_or_path": str(model_type_folder(tmp_path, "qwen3")), "template": "llama3"}
    (refused,) = [f for f in translate(raw, tmp_path / "x.yaml").refused() if f.key == "template"]
    assert "set template to a qwen3 template (qwen3, qwen3_nothink)" in refused.why


@pytest.mark.parametrize(
    ("template", "model_type"),
    [
        ("qwen3_nothink", "qwen3_moe"),
        ("llama3", "llama"),
        ("qwen", "qwen2"),
        ("gemma3", "gemma3_text"),
        ("deepseekr1", "qwen2"),  # distilled into Qwen and Llama models: not checked
    ],
)
def test_a_family_template_on_its_own_family_is_mapped_naming_the_type(
    template, model_type, tmp_path
):
    model = model_type_folder(tmp_path, model_type)
    raw = {"model_name_or_path": str(model), "do_train": True, "template": template}
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.refused() == []
    fate = {f.key: f for f in translation.fates}["template"]
    assert fate.target == "data.template" and f"model_type {model_type}" in fate.why
    assert translation.config["data"]["template"] == "auto"


def test_a_hub_model_is_checked_from_the_cache_and_unchecked_before_download(tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text('{"model_type": "qwen3"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    raw = {"model_name_or_path": "Qwen/Qwen3-0.6B", "do_train": True, "template": "llama3"}
    assert [f.key for f in translate(raw, tmp_path / "x.yaml").refused()] == ["template"]
    raw["template"] = "qwen3"
    assert translate(raw, tmp_path / "x.yaml").refused() == []
    raw.update(model_name_or_path="Qwen/Qwen3-8B", template="llama3")  # not in the cache
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.refused() == []
    assert "not checked" in {f.key: f for f in translation.fates}["template"].why


def test_lora_rank_and_alpha_as_they_read_them(tmp_path):
    raw = {"model_name_or_path": "m", "do_train": True, "lora_rank": 4, "lora_alpha": 0}
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.config["method"]["lora"] == {"r": 4, "alpha": 8, "dropout": 0.0}
    assert "method.lora.alpha = 8: 2 x lora_rank, their default" in translation.notes
    raw["lora_rank"] = None  # their alpha default and PEFT need a number: their run stops
    (refused,) = translate(raw, tmp_path / "x.yaml").refused()
    assert refused.key == "lora_rank" and "their default 8" in refused.why


@pytest.mark.parametrize("key", ["train_on_prompt", "mask_history"])
@pytest.mark.parametrize(
    ("stage", "value", "fate"),
    [
        ("sft", True, "mapped"),
        ("sft", False, "mapped"),
        ("dpo", True, "refused"),
        ("dpo", False, "ignored"),
    ],
)
def test_what_sft_trains_on_is_keels_and_their_other_stages_refuse_it(
    key, stage, value, fate, tmp_path
):
    raw = {"model_name_or_path": "m", "do_train": True, "stage": stage, key: value}
    translation = translate(raw, tmp_path / "x.yaml")
    assert {f.key: f for f in translation.fates}[key].fate == fate
    assert translation.config.get("data", {}).get(key) is (value if stage == "sft" else None)


def test_lora_variants_and_the_cosine_floor_are_keels(tmp_path):
    raw = {
        "model_name_or_path": "m",
        "do_train": True,
        "use_rslora": True,
        "loraplus_lr_ratio": 16.0,
        "loraplus_lr_embedding": 1e-6,
        "learning_rate": 1e-4,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr": 1e-5},
    }
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.refused() == []
    lora, train = translation.config["method"]["lora"], translation.config["train"]
    assert (lora["rslora"], lora["plus_lr_ratio"]) == (True, 16.0)
    assert (train["scheduler"], train["min_lr_ratio"]) == ("cosine", pytest.approx(0.1))
    assert {f.key: f.fate for f in translation.fates}["loraplus_lr_embedding"] == "ignored"
    raw["lr_scheduler_kwargs"] = {"min_lr_rate": 0.2}
    assert translate(raw, tmp_path / "x.yaml").config["train"]["min_lr_ratio"] == 0.2
    for kwargs in ({"num_cycles": 2, "min_lr_rate": 0.1}, {}, {"min_lr_rate": 0.1, "min_lr": 0}):
        refused = {
            f.key
            for f in translate(
                {**raw, "lr_scheduler_kwargs": kwargs}, tmp_path / "x.yaml"
            ).refused()
        }
        assert refused == ({"lr_scheduler_type"} if not kwargs else {"lr_scheduler_kwargs"})
    raw.update(lr_scheduler_type="linear", lr_scheduler_kwargs={"min_lr_rate": 0.1})
    (refused,) = translate(raw, tmp_path / "x.yaml").refused()
    assert "keel's schedules take no arguments" in refused.why


@pytest.mark.parametrize(
    ("value", "finetuning", "fate", "names"),
    [
        ("embed_tokens, lm_head", "lora", "mapped", ["embed_tokens", "lm_head"]),
        ("lm_head", "lora", "mapped", ["lm_head"]),
        ("", "lora", "ignored", None),
        ("lm_head", "full", "ignored", None),
    ],
)
def test_additional_target_trains_modules_in_full_beside_lora(
    value, finetuning, fate, names, tmp_path
):
    raw = {"model_name_or_path": "m", "do_train": True, "finetuning_type": finetuning}
    translation = translate({**raw, "additional_target": value}, tmp_path / "x.yaml")
    assert {f.key: f.fate for f in translation.fates}["additional_target"] == fate
    lora = translation.config.get("method", {}).get("lora", {})
    assert lora.get("modules_to_save") == names


def test_keyfate_needs_a_why_for_ignored_and_refused():
    with pytest.raises(AssertionError):
        KeyFate("x", "ignored")


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_keel_examples_are_no_dialect(path: Path):
    assert detect_dialect(yaml.safe_load(path.read_text(encoding="utf-8"))) is None


def test_detect_dialect():
    assert detect_dialect({"stage": "sft", "finetuning_type": "lora"}) == "llamafactory"
    assert detect_dialect({"base_model": "m", "adapter": "lora"}) == "axolotl"
    assert detect_dialect({"model": {"path": "m"}, "model_name_or_path": "x"}) is None


def test_the_family_check_reads_the_model_a_model_path_override_names(tmp_path):
    """`keel train lf.yaml model.path=<other>` trains the other model: the template is
    checked against that one, not the file's."""
    llama, qwen = model_type_folder(tmp_path, "llama"), model_type_folder(tmp_path, "qwen3")
    config = tmp_path / "lf.yaml"
    (tmp_path / "rows.json").write_text('[{"instruction": "q", "output": "a"}]')
    raw = {"model_name_or_path": str(llama), "template": "qwen3", "do_train": True,
           "dataset": "rows.json", "dataset_dir": str(tmp_path)}  # fmt: skip
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"model_name_or_path {llama} is a llama model"):
        load_config(config)
    shown = []
    cfg = load_config(config, [f"model.path={qwen}"], on_translation=shown.append)
    assert cfg.model.path == str(qwen) and cfg.data.template == "auto"
    fate = {f.key: f for f in shown[0].fates}["template"]
    assert "model.path is one (model_type qwen3)" in fate.why
    config.write_text(config.read_text().replace(str(llama), str(qwen)))  # and the other way
    with pytest.raises(ConfigError, match=rf"model.path {llama} is a llama model"):
        load_config(config, [f"model.path={llama}"])


@pytest.mark.parametrize(
    ("keys", "fate"),
    [
        ({"adapter_name_or_path": "saves/sft"}, "mapped"),
        ({"adapter_name_or_path": "saves/sft", "create_new_adapter": True}, "refused"),
        ({"adapter_name_or_path": "saves/a,saves/b"}, "refused"),
        ({"adapter_name_or_path": "saves/sft", "finetuning_type": "full"}, "refused"),
    ],
)
def test_their_adapter_to_resume_is_keels_model_adapter(keys, fate, tmp_path):
    raw = {"model_name_or_path": "m", "do_train": True, "stage": "dpo", **keys}
    translation = translate(raw, tmp_path / "x.yaml")
    assert {f.key: f.fate for f in translation.fates}["adapter_name_or_path"] == fate
    if fate == "mapped":
        assert translation.config["model"]["adapter"] == "saves/sft"


def test_the_adapter_they_resume_decides_the_lora_shape(tmp_path):
    raw = {
        "model_name_or_path": "m",
        "do_train": True,
        "adapter_name_or_path": "saves/sft",
        "lora_target": "all",
        "lora_rank": 64,  # PEFT's from_pretrained reads the adapter's, as keel does
    }
    translation = translate(raw, tmp_path / "x.yaml")
    fates = {f.key: f for f in translation.fates}
    assert fates["lora_rank"].fate == fates["lora_target"].fate == "ignored"
    assert "adapter_config.json" in fates["lora_rank"].why
    lora = translation.config["method"]["lora"]
    assert "r" not in lora and "alpha" not in lora and "targets" not in lora
    assert lora["dropout"] == 0.0  # training settings stay theirs
    assert not any(note.startswith("method.lora.alpha") for note in translation.notes)


def test_negative_freeze_trainable_layers_train_the_first_layers(tmp_path: Path):
    raw = {"model_name_or_path": "m", "do_train": True, "finetuning_type": "freeze"}
    translation = translate({**raw, "freeze_trainable_layers": -2}, tmp_path / "x.yaml")
    assert translation.config["method"]["freeze"] == {"trainable_layers": -2}
    assert translation.refused() == []


def test_added_tokens_become_keels_and_their_embedding_settings_say_how():
    their = {"model_name_or_path": "m", "do_train": True, "finetuning_type": "lora"}
    keys = {
        "add_tokens": "<think>, </think>",
        "add_special_tokens": "<tool>",
        "resize_vocab": True,
        "init_special_tokens": "noise_init",
    }
    translation = translate({**their, **keys}, Path("x.yaml"))
    assert translation.refused() == []
    model = translation.config["model"]
    assert model["add_tokens"] == ["<think>", "</think>"]
    assert model["add_special_tokens"] == ["<tool>"]
    fates = {f.key: f for f in translation.fates}
    assert "grows and trains the embeddings" in fates["resize_vocab"].why
    refused = translate(
        {**their, "resize_vocab": True, "init_special_tokens": "desc_init"}, Path("x")
    )
    reasons = {f.key: f.why for f in refused.fates if f.fate == "refused"}
    assert set(reasons) == {"resize_vocab", "init_special_tokens"}
    assert "additional_target" in reasons["resize_vocab"]


def test_a_llamafactory_v1_config_is_named_as_such_in_one_problem(tmp_path: Path):
    """Their experimental v1 trainer's format (examples/v1): one problem saying what the
    file is and what keel reads, not an unknown-key error per key."""
    v1 = {
        "model": "Qwen/Qwen3-4B", "model_class": "llm",
        "peft_config": {"name": "lora", "r": 16, "lora_alpha": 32, "target_modules": "all"},
        "dist_config": {"name": "fsdp2"}, "train_dataset": "data/v1_sft_demo.yaml",
        "output_dir": "./outputs/test_lora", "micro_batch_size": 1, "learning_rate": 1e-4,
    }  # fmt: skip
    path = tmp_path / "v1.yaml"
    path.write_text(yaml.safe_dump(v1))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert "LLaMA-Factory v1 config" in problem and "model_class, peft_config" in problem

    from keel.config.dialects.commands import translate_command

    with pytest.raises(ConfigError, match="LLaMA-Factory v1 config"):
        translate_command({"model": "m", "peft_config": {"name": "lora"}}, path, "export")
    # keel's own model section, or a string model without their v1 keys, is not theirs
    keel = {"model": {"path": "m"}, "method": {"type": "lora"}}
    from keel.config.dialects import unread_dialect

    assert unread_dialect(keel) is None and unread_dialect({"model": "m"}) is None


def test_streaming_reads_the_data_as_training_goes(tmp_path: Path):
    raw, source = _their_config("qwen3_lora_sft.yaml", tmp_path)
    raw.update(streaming=True, buffer_size=128, max_steps=10)
    translation = translate(raw, source)
    assert translation.config["data"]["streaming"] is True
    fates = {f.key: f for f in translation.fates}
    assert (
        fates["buffer_size"].fate == "ignored" and "shuffles the files" in fates["buffer_size"].why
    )


def test_their_oft_is_keels_oft_as_their_code_reads_it(tmp_path: Path):
    """finetuning_type oft: the block size maps, lora_target (not oft_target, which their
    code never reads) names the adapted modules, additional_target trains in full beside,
    and module_dropout, which PEFT's OFT builds but never applies, is ignored saying so."""
    raw = {
        "model_name_or_path": "m",
        "do_train": True,
        "finetuning_type": "oft",
        "oft_block_size": 16,
        "oft_target": "q_proj",
        "lora_target": "q_proj,v_proj",
        "module_dropout": 0.1,
        "additional_target": "lm_head",
    }
    translation = translate(raw, tmp_path / "x.yaml")
    assert translation.refused() == []
    assert translation.config["method"] == {
        "type": "oft",
        "oft": {"block_size": 16, "targets": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
    }
    fates = {f.key: f for f in translation.fates}
    assert fates["oft_target"].fate == "ignored" and "never reads" in fates["oft_target"].why
    assert "never applies it" in fates["module_dropout"].why
    rank = translate({**raw, "oft_rank": 4, "oft_block_size": 0}, tmp_path / "x.yaml")
    assert {f.key for f in rank.refused()} == {"oft_rank", "oft_block_size"}
    (quantized,) = translate({**raw, "quantization_bit": 4}, tmp_path / "x.yaml").refused()
    assert quantized.key == "quantization_bit" and "under LoRA only" in quantized.why
    lora = translate({**raw, "finetuning_type": "lora"}, tmp_path / "x.yaml")
    assert lora.config["method"]["lora"]["targets"] == ["q_proj", "v_proj"]
    assert {f.key: f.fate for f in lora.fates}["oft_block_size"] == "ignored"


@pytest.mark.parametrize(
    ("keys", "iters", "convert"),
    [
        ({"pissa_iter": -1, "pissa_convert": True}, 0, "their pissa_converted/ folder"),
        ({"pissa_iter": 16}, 16, None),
        ({"pissa_convert": False}, None, "only fits their residual base"),
    ],
)
def test_llamafactory_pissa_is_method_lora_init_pissa(keys, iters, convert):
    their = {"model_name_or_path": "m", "do_train": True, "finetuning_type": "lora"}
    translation = translate_llamafactory({**their, "pissa_init": True, **keys}, Path("x.yaml"))
    assert translation.refused() == []
    lora = translation.config["method"]["lora"]
    assert (lora["init"], lora.get("pissa_iters")) == ("pissa", iters)
    if convert:
        (fate,) = [f for f in translation.fates if f.key == "pissa_convert"]
        assert fate.fate == "ignored" and convert in fate.why
    off = translate_llamafactory({**their, "pissa_iter": 4}, Path("x.yaml"))
    assert "init" not in off.config["method"].get("lora", {})  # read with pissa_init only


@pytest.mark.parametrize(
    ("method", "value", "fate"),
    [("freeze", True, "mapped"), ("lora", True, "refused"), ("freeze", False, "ignored")],
)
def test_llama_pro_is_freezes_expanded_blocks(method, value, fate):
    """Their examples/extras/llama_pro: freeze tuning of the blocks their script inserted."""
    their = {"model_name_or_path": "m", "do_train": True, "finetuning_type": method}
    keys = {"use_llama_pro": value, "freeze_trainable_layers": 8}
    translation = translate_llamafactory({**their, **keys}, Path("x.yaml"))
    (got,) = [f for f in translation.fates if f.key == "use_llama_pro"]
    assert got.fate == fate, got
    if fate == "mapped":
        assert translation.config["method"]["freeze"] == {
            "trainable_layers": 8, "expanded_blocks": True
        }  # fmt: skip
