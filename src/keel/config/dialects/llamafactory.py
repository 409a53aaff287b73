"""LLaMA-Factory's training YAML as a keel config. Key meanings and defaults are theirs
(hparams dataclasses + Hugging Face TrainingArguments); where they leave a key out and
their default differs from keel's, keel writes theirs so the run means the same."""

from __future__ import annotations

from pathlib import Path

from keel.config.dialects.build import (
    Build,
    at_their_default,
    eval_strategy,
    llamafactory_muon,
    optimizer,
    save_strategy,
    scheduler,
)
from keel.config.dialects.deepspeed import apply_deepspeed
from keel.config.dialects.llamafactory_defaults import THEIR_DEFAULTS
from keel.config.dialects.llamafactory_keys import KEY_RULES, Rule, keel_stage
from keel.config.dialects.report import Translation, unknown_key
from keel.config.dialects.token_weighting import LLAMAFACTORY_HANDLERS


def translate_llamafactory(
    raw: dict, source: Path, model_override: dict | None = None
) -> Translation:
    """`raw` (their YAML, read from `source`) as a keel Translation; every key has a fate.
    `model_override`: keel's model section as the command line sets it (path, revision)."""
    build = Build(
        raw=raw, source=source, stage=keel_stage(raw), model_override=model_override or {}
    )
    for key, value in raw.items():
        rule = RULES.get(str(key))
        if rule is not None:
            rule(build, str(key), value)
        elif str(key) in THEIR_DEFAULTS:
            at_their_default(build, str(key), value, THEIR_DEFAULTS[str(key)])
        else:
            why = unknown_key(
                str(key), RULES, "not a LLaMA-Factory training key keel knows; remove it"
            )
            build.refused(str(key), why)
    _datasets(build)
    _defaults(build)
    return build.translation("llamafactory")


def _dataset_keys(build: Build, key: str, value) -> None:
    """dataset and max_samples become data.datasets once all keys are read (_datasets)."""
    if key == "dataset":
        build.mapped(key, "data.datasets", "names in dataset_dir's dataset_info.json")
    elif value is None:
        build.ignored(key, "null: every row")
    else:
        build.mapped(key, "data.datasets.*.max_samples", "the first N rows of each dataset")


def _datasets(build: Build) -> None:
    """dataset and eval_dataset (names, a list or comma-separated) as data.datasets and
    data.eval_datasets; their max_samples cuts each dataset of both, as theirs does."""
    for key, target in (("dataset", "data.datasets"), ("eval_dataset", "data.eval_datasets")):
        names = build.raw.get(key)
        if names is None:
            continue
        listed = names if isinstance(names, list) else str(names).split(",")
        limit = build.raw.get("max_samples")
        entries = [{"path": str(name).strip()} for name in listed if str(name).strip()]
        for entry in entries:
            if limit is not None:
                entry["max_samples"] = limit
        build.set(target, entries)


def _eval_dataset(build: Build, key: str, value) -> None:
    if value is None:
        build.ignored(key, "null: val_size (if any) holds rows out for evaluation")
    else:  # written by _datasets once every key is read
        why = "names in dataset_dir's dataset_info.json, evaluated instead of rows held out"
        build.mapped(key, "data.eval_datasets", why)


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


def _adam_beta(build: Build, key: str, value) -> None:
    betas = [build.raw.get("adam_beta1", 0.9), build.raw.get("adam_beta2", 0.999)]
    build.put(key, "train.adam_betas", betas)


def _max_steps(build: Build, key: str, value) -> None:
    if value is None or value <= 0:
        build.ignored(key, f"{value}: unset, num_train_epochs decides")
    else:
        build.put(key, "train.max_steps", value)


def _moe_aux_loss(build: Build, key: str, value) -> None:
    """LLaMA-Factory turns on the routers' output and sets their coefficient when this is
    set (not 0)."""
    if not value:
        build.ignored(key, f"{value}: no balance loss, keel's default")
    else:
        build.put(key, "train.router_aux_loss_coef", value, "the routers' load-balancing loss")


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


def _flag(build: Build, key: str, value) -> None:
    """do_train / do_eval: what keel train does anyway, or refused when switched off."""
    if key == "do_eval":
        build.ignored(
            key, "keel evaluates whenever there is evaluation data (val_size, eval_dataset)"
        )
    elif value:
        build.ignored(key, "keel train always trains")
    else:
        build.refused(key, "false: keel train trains; use keel validate to check only")


def _added_tokens(build: Build, key: str, value) -> None:
    """add_tokens / add_special_tokens: comma-separated tokens for the tokenizer."""
    tokens = [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else []
    if tokens:
        build.put(key, f"model.{key}", tokens, "new ones get embedding rows, trained in full")
    elif not value:
        build.ignored(key, "empty")
    else:
        build.refused(key, f"{value!r}: tokens, comma-separated")


def _resize_vocab(build: Build, key: str, value) -> None:
    adds = any(build.raw.get(k) for k in ("add_tokens", "add_special_tokens"))
    if not value:
        build.ignored(key, "false")
    elif adds:
        build.ignored(key, "keel grows and trains the embeddings for added tokens itself")
    else:
        build.refused(
            key,
            "true without added tokens trains the embeddings in full: name them in "
            "additional_target (LoRA) or freeze_extra_modules",
        )


def _init_special_tokens(build: Build, key: str, value) -> None:
    if value == "noise_init":
        build.ignored(key, "noise_init: keel starts new rows at the known rows' mean, no noise")
    else:
        build.refused(key, f"{value}: keel starts new rows at the mean of the known rows")


def _refuse(why: str) -> Rule:
    return lambda build, key, _value: build.refused(key, why)


RULES: dict[str, Rule] = {
    **KEY_RULES,
    "deepspeed": apply_deepspeed,
    "dataset": _dataset_keys,
    "max_samples": _dataset_keys,
    "dataset_dir": _dataset_dir,
    "packing": _packing,
    "neat_packing": _packing,
    "bf16": _precision,
    "fp16": _precision,
    "pure_bf16": _precision,
    "lr_scheduler_type": scheduler,
    "optim": optimizer,
    "use_muon": llamafactory_muon,
    "adam_beta1": _adam_beta,
    "adam_beta2": _adam_beta,
    "max_steps": _max_steps,
    "moe_aux_loss_coef": _moe_aux_loss,
    **LLAMAFACTORY_HANDLERS,
    "gradient_checkpointing": _gradient_checkpointing,
    "disable_gradient_checkpointing": _gradient_checkpointing,
    "report_to": _report_to,
    "run_name": _run_name,
    "resume_from_checkpoint": _resume,
    "save_strategy": save_strategy,
    "eval_strategy": eval_strategy,
    "evaluation_strategy": eval_strategy,
    "do_train": _flag,
    "do_eval": _flag,
    "eval_dataset": _eval_dataset,
    "ray_num_workers": _refuse("keel launches its own processes: keel train --nproc N"),
    "ref_model": _refuse("the reference is the policy's start (adapters off, or a copy)"),
    "add_tokens": _added_tokens,
    "add_special_tokens": _added_tokens,
    "resize_vocab": _resize_vocab,
    "init_special_tokens": _init_special_tokens,
    "new_special_tokens_config": _refuse(
        "descriptions to start token rows from: keel starts them at the known rows' mean; "
        "list the tokens in add_special_tokens"
    ),
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
        _lora_defaults(build)
    if build.stage == "pt":
        _pretraining_defaults(build)
    _default(build, "dataset_dir", "data.dataset_dir", "data", "relative to the working directory")
    _default(build, "cutoff_len", "data.cutoff_len", 2048, "cutoff_len's default")
    _default(build, "per_device_train_batch_size", "train.micro_batch_size", 8, "HF's default")
    _default(build, "learning_rate", "train.lr", 5e-5, "HF's default")
    _default(build, "num_train_epochs", "train.epochs", 3.0, "HF's default")
    _default(build, "lr_scheduler_type", "train.scheduler", "linear", "HF's default")
    _default(build, "output_dir", "output.dir", "trainer_output", "HF's default")
    _default(build, "logging_steps", "output.log_every", 500, "HF's default")
    _default(build, "save_steps", "output.save_every", 500, "HF's default")
    if not any(key in raw for key in ("gradient_checkpointing", "disable_gradient_checkpointing")):
        build.kept("train.gradient_checkpointing", True, "on unless disabled")
    if not raw.get("bf16") and not raw.get("fp16") and not raw.get("pure_bf16"):
        build.kept("train.precision", "fp32", "neither bf16 nor fp16 is set")


def _pretraining_defaults(build: Build) -> None:
    """Stage pt packs unless packing is false; packed, their texts are joined and cut into
    blocks of cutoff_len tokens (keel: each long text cut into pieces, attention within
    each), and unpacked each text is truncated to cutoff_len."""
    raw = build.raw
    packs = bool(raw.get("neat_packing")) or raw.get("packing") in (None, True)
    if raw.get("packing") is None and not raw.get("neat_packing"):
        build.kept("data.packing", True, "stage pt packs by default (attention per sample)")
    if packs:
        why = "packed, stage pt cuts the joined texts into cutoff_len blocks; keel cuts each text"
    else:
        why = "unpacked, stage pt truncates each text to cutoff_len"
    build.kept("data.overlength", "split" if packs else "truncate", why)


def _lora_defaults(build: Build) -> None:
    """Their LoRA rank 8, alpha 2 x rank (an alpha of 0 or null too) and dropout 0."""
    _default(build, "lora_rank", "method.lora.r", 8, "lora_rank's default")
    rank = build.raw.get("lora_rank", 8)
    if not build.raw.get("lora_alpha") and isinstance(rank, int):
        build.kept("method.lora.alpha", rank * 2, "2 x lora_rank, their default")
    _default(build, "lora_dropout", "method.lora.dropout", 0.0, "lora_dropout's default")


def _default(build: Build, key: str, target: str, value, why: str) -> None:
    """Their default for `key` where their file leaves it out and keel's differs: write it."""
    if key not in build.raw:
        build.kept(target, value, why)
