"""LLaMA-Factory's training YAML as a keel config. Key meanings and defaults are theirs
(hparams dataclasses + Hugging Face TrainingArguments); where they leave a key out and
their default differs from keel's, keel writes theirs so the run means the same."""

from __future__ import annotations

from pathlib import Path

from keel.config.dialects.deepspeed import read_deepspeed
from keel.config.dialects.llamafactory_keys import KEY_RULES, Build, Rule
from keel.config.dialects.report import Translation, unknown_key


def translate_llamafactory(raw: dict, source: Path) -> Translation:
    """`raw` (their YAML, read from `source`) as a keel Translation; every key has a fate."""
    build = Build(raw=raw, source=source)
    for key, value in raw.items():
        rule = RULES.get(str(key))
        if rule is None:
            why = unknown_key(
                str(key), RULES, "not a LLaMA-Factory training key keel knows; remove it"
            )
            build.refused(str(key), why)
        else:
            rule(build, str(key), value)
    _datasets(build)
    _defaults(build)
    return Translation(
        dialect="llamafactory", config=build.config, fates=build.fates, notes=build.notes
    )


def _deepspeed(build: Build, key: str, value) -> None:
    if value is None:
        build.ignored(key, "null: no DeepSpeed")
        return
    settings, fates = read_deepspeed(value, build.source, key)
    for dotted, setting in settings.items():
        build.set(dotted, setting)
    if settings:
        build.mapped(key, ", ".join(settings), "from the JSON: its keys follow")
    build.fates.extend(fates)


def _dataset_keys(build: Build, key: str, value) -> None:
    """dataset and max_samples become data.datasets once all keys are read (_datasets)."""
    if key == "dataset":
        build.mapped(key, "data.datasets", "names in dataset_dir's dataset_info.json")
    elif value is None:
        build.ignored(key, "null: every row")
    else:
        build.mapped(key, "data.datasets.*.max_samples", "the first N rows of each dataset")


def _datasets(build: Build) -> None:
    names = build.raw.get("dataset")
    if names is None:
        return
    listed = names if isinstance(names, list) else str(names).split(",")
    limit = build.raw.get("max_samples")
    entries = [{"path": str(name).strip()} for name in listed if str(name).strip()]
    for entry in entries:
        if limit is not None:
            entry["max_samples"] = limit
    build.set("data.datasets", entries)


def _dataset_dir(build: Build, key: str, value) -> None:
    if str(value).startswith("REMOTE:"):
        build.refused(key, "a remote dataset folder; download it and give its local path")
    else:
        build.put(key, "data.dataset_dir", str(value), "relative to the working directory")


def _packing(build: Build, key: str, value) -> None:
    if key == "neat_packing":
        if value:
            build.put(key, "data.packing", True, "keel's packing keeps attention per sample")
        else:
            build.ignored(key, "false: packing (if on) keeps attention per sample anyway")
    elif value is None:
        build.ignored(key, "null: on for stage pt only, written by the defaults below")
    else:
        why = "keel's packing keeps attention within each sample (their neat_packing)"
        build.put(key, "data.packing", bool(value), why if value else "")


def _precision(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "false")
    elif build.raw.get("bf16") and build.raw.get("fp16"):
        build.refused(key, "bf16 and fp16 are both true; keep one")
    else:
        precision = "fp16" if key == "fp16" else "bf16"
        build.put(key, "train.precision", precision)


_SCHEDULERS = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}


def _scheduler(build: Build, key: str, value) -> None:
    if value in _SCHEDULERS:
        build.put(key, "train.scheduler", _SCHEDULERS[value], "after train.warmup_*")
    else:
        build.refused(key, f"{value}: keel's schedulers are linear, cosine and constant")


_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "adamw_8bit": "adamw_8bit",
    "adamw_bnb_8bit": "adamw_8bit",
    "paged_adamw_8bit": "adamw_8bit",
}


def _optim(build: Build, key: str, value) -> None:
    if value in _OPTIMIZERS:
        choice = _OPTIMIZERS[value]
        build.put(key, "train.optimizer", choice, "torchao's 8-bit AdamW" if "8" in choice else "")
    else:
        build.refused(key, f"{value}: keel's optimizers are adamw, adamw_8bit and adamw_4bit")


def _adam_beta(build: Build, key: str, value) -> None:
    betas = [build.raw.get("adam_beta1", 0.9), build.raw.get("adam_beta2", 0.999)]
    build.put(key, "train.adam_betas", betas)


def _max_steps(build: Build, key: str, value) -> None:
    if value is None or value <= 0:
        build.ignored(key, f"{value}: unset, num_train_epochs decides")
    else:
        build.put(key, "train.max_steps", value)


def _gradient_checkpointing(build: Build, key: str, value) -> None:
    on = not value if key == "disable_gradient_checkpointing" else bool(value)
    build.put(key, "train.gradient_checkpointing", on)


def _report_to(build: Build, key: str, value) -> None:
    names = value if isinstance(value, list) else str(value).split(",")
    names = [str(name).strip() for name in names if str(name).strip() not in ("", "none")]
    unknown = [name for name in names if name not in ("tensorboard", "wandb")]
    if unknown:
        why = f"{', '.join(unknown)}: keel logs to metrics.jsonl, tensorboard and wandb"
        build.refused(key, why)
    else:
        build.put(key, "output.loggers", ["jsonl", *names], "metrics.jsonl is always written")


def _run_name(build: Build, key: str, value) -> None:
    if "wandb" in str(build.raw.get("report_to", "")):
        build.put(key, "output.wandb.name", str(value))
    else:
        build.ignored(key, "names a run of a logger keel does not use here (report_to)")


def _resume(build: Build, key: str, value) -> None:
    if value is None or value is True:
        why = "the newest complete checkpoint in output.dir, if any"
        build.put(key, "train.resume", "auto", why)
    elif value is False:
        build.put(key, "train.resume", "never")
    elif (Path(str(value)) / "trainer_state.json").is_file():
        build.refused(key, f"{value} is a Hugging Face Trainer checkpoint, not keel's")
    else:
        build.put(key, "train.resume", str(value), "a keel checkpoint folder")


def _save_strategy(build: Build, key: str, value) -> None:
    if value == "no":
        build.put(key, "output.save_every", 0, "no: the final save only")
    elif value == "steps":
        build.ignored(key, "steps: save_steps sets output.save_every")
    else:
        build.refused(key, f"{value}: keel saves every output.save_every steps (save_steps)")


def _eval_strategy(build: Build, key: str, value) -> None:
    if value == "steps":
        build.ignored(key, "steps: eval_steps sets train.eval_every")
    elif value == "no":
        build.ignored(key, "no: keel evaluates at the end when data.val_size holds rows out")
    else:
        build.refused(key, f"{value}: keel evaluates every train.eval_every steps (eval_steps)")


def _flag(build: Build, key: str, value) -> None:
    """do_train / do_eval: what keel train does anyway, or refused when switched off."""
    if key == "do_eval":
        build.ignored(key, "keel evaluates on data.val_size's rows whenever it holds some")
    elif value:
        build.ignored(key, "keel train always trains")
    else:
        build.refused(key, "false: keel train trains; use keel validate to check only")


def _refuse(why: str) -> Rule:
    return lambda build, key, _value: build.refused(key, why)


RULES: dict[str, Rule] = {
    **KEY_RULES,
    "deepspeed": _deepspeed,
    "dataset": _dataset_keys,
    "max_samples": _dataset_keys,
    "dataset_dir": _dataset_dir,
    "packing": _packing,
    "neat_packing": _packing,
    "bf16": _precision,
    "fp16": _precision,
    "pure_bf16": _precision,
    "lr_scheduler_type": _scheduler,
    "optim": _optim,
    "adam_beta1": _adam_beta,
    "adam_beta2": _adam_beta,
    "max_steps": _max_steps,
    "gradient_checkpointing": _gradient_checkpointing,
    "disable_gradient_checkpointing": _gradient_checkpointing,
    "report_to": _report_to,
    "run_name": _run_name,
    "resume_from_checkpoint": _resume,
    "save_strategy": _save_strategy,
    "eval_strategy": _eval_strategy,
    "evaluation_strategy": _eval_strategy,
    "do_train": _flag,
    "do_eval": _flag,
    "eval_dataset": _refuse("keel evaluates on rows held out by data.val_size (val_size)"),
    "ray_num_workers": _refuse("keel launches its own processes: keel train --nproc N"),
    "ref_model": _refuse("the reference is the policy's start (adapters off, or a copy)"),
}


def _defaults(build: Build) -> None:
    """Their defaults for the keys they left out, where keel's default differs."""
    raw, method = build.raw, build.config.get("method", {}).get("type", "lora")
    if "do_train" not in raw:
        # do_train is false by default and their workflows train only when it is true: a
        # config without it (qwen3_preprocess.yaml: tokenize and save) trains nothing there
        why = "left out, so false: LLaMA-Factory would not train; add `do_train: true`"
        build.refused("do_train", why)
    if method in ("lora", "qlora"):
        rank = raw.get("lora_rank", 8)
        build.default("lora_rank", "method.lora.r", 8, "lora_rank's default")
        if raw.get("lora_alpha") is None:
            build.set("method.lora.alpha", rank * 2)
            build.notes.append(f"method.lora.alpha = {rank * 2}: 2 x lora_rank, their default")
        build.default("lora_dropout", "method.lora.dropout", 0.0, "lora_dropout's default")
    if build.stage == "pt" and "packing" not in raw and "neat_packing" not in raw:
        build.set("data.packing", True)
        build.notes.append("data.packing = True: stage pt packs by default (attention per sample)")
    build.default("dataset_dir", "data.dataset_dir", "data", "relative to the working directory")
    build.default("cutoff_len", "data.cutoff_len", 2048, "cutoff_len's default")
    build.default("per_device_train_batch_size", "train.micro_batch_size", 8, "HF's default")
    build.default("learning_rate", "train.lr", 5e-5, "HF's default")
    build.default("num_train_epochs", "train.epochs", 3.0, "HF's default")
    build.default("lr_scheduler_type", "train.scheduler", "linear", "HF's default")
    build.default("output_dir", "output.dir", "trainer_output", "HF's default")
    build.default("logging_steps", "output.log_every", 500, "HF's default")
    build.default("save_steps", "output.save_every", 500, "HF's default")
    if not any(key in raw for key in ("gradient_checkpointing", "disable_gradient_checkpointing")):
        build.set("train.gradient_checkpointing", True)
        build.notes.append("train.gradient_checkpointing = True: on unless disabled")
    if not raw.get("bf16") and not raw.get("fp16") and not raw.get("pure_bf16"):
        build.set("train.precision", "fp32")
        build.notes.append("train.precision = fp32: neither bf16 nor fp16 is set")
