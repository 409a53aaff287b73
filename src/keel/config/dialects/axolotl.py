"""Axolotl configs as keel configs: each of their keys mapped, ignored (why) or refused (why).

Key names and defaults follow Axolotl's config schema (src/axolotl/utils/schemas). Keys
left out where Axolotl's default differs from keel's are written out and named in the
Translation's notes (no adapter: full fine-tuning; no output_dir: ./model-out).
"""

from __future__ import annotations

from pathlib import Path

from keel.config.dialects.axolotl_data import dataset_stage, min_sample_len, translate_datasets
from keel.config.dialects.axolotl_defaults import THEIR_DEFAULTS
from keel.config.dialects.axolotl_qat import QAT_HANDLERS
from keel.config.dialects.axolotl_runtime import RUNTIME_HANDLERS, offloads_activations
from keel.config.dialects.axolotl_streaming import STREAMING_HANDLERS, pretraining_stage
from keel.config.dialects.axolotl_tokens import added_tokens, mistral_common, special_tokens
from keel.config.dialects.axolotl_training import TRAINING_HANDLERS, yaml_number
from keel.config.dialects.axolotl_trl import STAGE_KEYS, stage_defaults, translate_stage_key
from keel.config.dialects.build import (
    Build,
    at_their_default,
    eval_strategy,
    optimizer,
    save_strategy,
    scheduler,
)
from keel.config.dialects.report import Translation, unknown_key
from keel.config.dialects.templates import axolotl_chat_template, axolotl_chat_template_jinja
from keel.config.dialects.token_weighting import AXOLOTL_HANDLERS as TOKEN_WEIGHTING_HANDLERS

DIRECT = {
    "base_model": "model.path",
    "revision_of_model": "model.revision",
    "trust_remote_code": "model.trust_remote_code",
    "lora_r": "method.lora.r",
    "lora_alpha": "method.lora.alpha",
    "lora_dropout": "method.lora.dropout",
    "peft_use_rslora": "method.lora.rslora",
    "peft_use_dora": "method.lora.dora",
    "loraplus_lr_ratio": "method.lora.plus_lr_ratio",
    "lora_modules_to_save": "method.lora.modules_to_save",
    "sequence_len": "data.cutoff_len",
    "val_set_size": "data.val_size",
    "micro_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "num_epochs": "train.epochs",
    "max_steps": "train.max_steps",
    "learning_rate": "train.lr",
    "warmup_ratio": "train.warmup_ratio",
    "warmup_steps": "train.warmup_steps",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "adam_epsilon": "train.adam_eps",
    "seed": "train.seed",
    "output_dir": "output.dir",
    "logging_steps": "output.log_every",
    "save_total_limit": "output.keep_last",
    "wandb_project": "output.wandb.project",
    "wandb_entity": "output.wandb.entity",
    "wandb_name": "output.wandb.name",
    "wandb_mode": "output.wandb.mode",
    "resume_from_checkpoint": "train.resume",
    "early_stopping_patience": "train.early_stopping_patience",
}
IGNORED = {
    "eval_batch_size": "keel evaluates with train.micro_batch_size",
    "loraplus_lr_embedding": "keel's LoRA+ trains every LoRA B matrix at loraplus_lr_ratio, "
    "embedding layers' too; this lr is theirs for LoRA on embedding layers, which "
    "`lora_target_linear` does not adapt",
    "dataset_prepared_path": "keel tokenizes the datasets when the run starts (and caches "
    "them itself); there is no prepared-dataset folder",
    "skip_prepare_dataset": "keel tokenizes the datasets when the run starts",
    "strict": "keel always checks every key",
    "model_type": "keel loads the architecture that the model's config.json names",
    "tokenizer_type": "keel loads the model's own tokenizer (AutoTokenizer)",
    "processor_type": "keel loads the model's own processor (AutoProcessor) for "
    "vision-language models",
    "hub_model_id": "keel does not upload; the model is written to output.dir",
    "hub_strategy": "keel does not upload; the model is written to output.dir",
    "wandb_watch": "keel does not log gradients or parameters to W&B",
    "wandb_log_model": "keel does not upload checkpoints to W&B; they stay in output.dir",
    "eval_sample_packing": "keel has no separate packing setting for evaluation",
    "tf32": "keel leaves TF32 matmuls to PyTorch's default",
    "gradient_checkpointing_kwargs": "keel's activation checkpointing is non-reentrant and "
    "takes no options",
    "loss_watchdog_threshold": "keel stops a run whose loss is not finite (exit 6); it has no "
    "loss-threshold stop",
    "loss_watchdog_patience": "keel stops a run whose loss is not finite (exit 6)",
    "remove_unused_columns": "keel reads only the columns its data format names",
    "pad_to_sequence_len": "keel never pads rows to data.cutoff_len (train.padding_free lays "
    "a micro-batch's samples end to end)",
    "group_by_length": "keel's data order is a function of train.seed alone",
    "save_first_step": "keel saves every output.save_every steps and at the end",
    "ddp_timeout": "keel's watchdog reports hangs in seconds (watchdog.hang_timeout_s)",
    "dataloader_num_workers": "keel's data loading has no worker processes to set",
    "dataloader_pin_memory": "keel's data loading has no such setting",
    "dataloader_prefetch_factor": "keel's data loading has no such setting",
    "vllm": "keel generates GRPO completions with its own engine in the training process",
    "eot_tokens": "keel finds each assistant turn's end in the chat template's rendering and "
    "trains it with the turn, as Axolotl does with these tokens",
    "ddp_find_unused_parameters": "keel's DDP wraps only the weights that train",
    "save_only_model": "keel's checkpoints always hold the optimizer and data state, so a "
    "resumed run continues exactly; the final model is saved in Hugging Face format",
    "low_cpu_mem_usage": "keel always builds the model empty (on the meta device) and fills "
    "each process's shards from the weight files, never a full copy in host memory first",
    "resize_token_embeddings_to_32x": "keel keeps the model's embeddings as they are, grown "
    "to the tokenizer's length only where added tokens need rows (model.add_tokens); Axolotl "
    "pads them, for speed, only where they hold fewer rows than the tokenizer's length "
    "rounded up to 32",
    "experimental_skip_move_to_device": "keel builds the model on the meta device and each "
    "process fills only its own shards: no whole model is ever moved to a device first",
}
# The same attention computed by other kernels: keel's auto picks its own (note why).
_SAME_ATTENTION = (
    "the same attention by other kernels; keel's auto takes flash_attention_2 on a CUDA GPU "
    "with flash-attn installed, else sdpa"
)
_ATTENTION = {
    "flash_attention_2": (
        "auto",
        "keel's auto takes flash_attention_2 on a CUDA GPU with flash-attn installed, else sdpa",
    ),
    "flash_attention": (
        "auto",
        "keel's auto takes flash_attention_2 on a CUDA GPU with flash-attn installed, else sdpa",
    ),
    "sdpa": ("sdpa", ""),
    "sdp_attention": ("sdpa", ""),
    "eager": ("eager", ""),
    "eager_attention": ("eager", ""),
    "xformers": ("auto", _SAME_ATTENTION),
    "flex_attention": ("auto", _SAME_ATTENTION),
    "kernels-community/vllm-flash-attn3": ("auto", _SAME_ATTENTION),
}


def translate_axolotl(raw: dict, source: Path, model_override: dict | None = None) -> Translation:
    """`raw` (an Axolotl YAML, read from `source`) as a keel Translation; every key of
    theirs, at any depth, has a fate. `model_override`: keel's model section as the command
    line sets it (path, revision)."""
    build = Build(
        raw=raw, source=Path(source), stage=_stage(raw), model_override=model_override or {}
    )
    build.set("train.stage", build.stage)
    for key, value in raw.items():
        _one_key(build, str(key), value)
    _defaults(build)
    return build.translation("axolotl")


def _stage(raw: dict) -> str:
    rl = raw.get("rl")
    if rl in ("dpo", "ipo", "orpo", "simpo", "kto", "grpo"):
        return "dpo" if rl == "ipo" else rl
    if raw.get("reward_model"):
        return "rm"
    return dataset_stage(raw.get("datasets")) or pretraining_stage(raw) or "sft"


def _one_key(build: Build, key: str, value) -> None:
    handler = _HANDLERS.get(key)
    if handler is not None and (value is not None or key in _NULL_MEANS_SOMETHING):
        handler(build, key, value)
    elif translate_stage_key(build, key, value):
        return
    elif value is None:  # empty changes nothing, even under a key keel does not know
        why = "empty, so it changes nothing (a key keel does not know)"
        build.ignored(
            key, "empty: Axolotl's default" if key in _KNOWN else unknown_key(key, _KNOWN, why)
        )
    elif key in DIRECT:
        build.put(
            key,
            DIRECT[key],
            yaml_number(value)
            if isinstance(value, str) and key not in ("base_model", "output_dir", "wandb_name")
            else value,
        )
    elif key in IGNORED:
        build.ignored(key, IGNORED[key])
    elif key in THEIR_DEFAULTS:
        at_their_default(build, key, value, THEIR_DEFAULTS[key])
    else:
        why = "an Axolotl key keel has no counterpart for; remove it"
        build.refused(key, unknown_key(key, _KNOWN, why))


def _adapter(build: Build, key: str, value) -> None:
    if value in ("lora", "qlora"):
        build.put(key, "method.type", value)
    elif value is None and build.raw.get("unfrozen_parameters"):
        build.mapped(key, "method.type", "no adapter: unfrozen_parameters choose what trains")
    elif value is None:
        build.put(key, "method.type", "full", "no adapter: every weight trains")
    else:
        build.refused(key, f"adapter {value!r}: keel's adapters are lora and qlora")


def _load_in_4bit(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "false: the base is not quantised")
    elif build.raw.get("adapter") == "qlora":
        build.put(key, "method.qlora.quant", "nf4", "4-bit NF4 base weights (QLoRA)")
    else:
        build.refused(key, "a 4-bit base trains only with adapter: qlora")


def _load_in_8bit(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "false: the base is not quantised")
    elif build.raw.get("adapter") == "lora":
        build.ignored(
            key,
            "keel has no 8-bit base; LoRA trains on the base in "
            "train.precision (more memory: `keel plan` shows it; adapter: qlora "
            "quantises the base to 4 bits)",
        )
    else:
        build.refused(key, "keel has no 8-bit base weights; use adapter: qlora (4-bit)")


def _targets(build: Build, key: str, value) -> None:
    if key == "lora_target_linear":
        if value:
            build.put(key, "method.lora.targets", "all-linear")
        else:
            build.ignored(key, "false: lora_target_modules names the targets")
    elif build.raw.get("lora_target_linear"):
        build.ignored(key, "lora_target_linear: true already targets every linear layer")
    elif value is None:
        build.ignored(key, "empty: Axolotl's default")
    else:
        build.put(key, "method.lora.targets", value)


def _lora_model_dir(build: Build, key: str, value) -> None:
    if value is None:
        build.ignored(key, "empty: new adapters are trained")
    else:
        build.put(key, "model.adapter", value, "keeps training that adapter")


def _precision(build: Build, key: str, value) -> None:
    """bf16 and fp16 together decide train.precision (bf16 first, as in Axolotl), unless
    their non-AMP bfloat16 or float16 does."""
    pure = next((k for k in ("bfloat16", "float16") if build.raw.get(k)), None)
    if pure is not None:
        if value and (key == "bf16") != (pure == "bfloat16"):
            build.refused(key, f"{key} and {pure} ask for different precisions; keep one")
        else:
            build.ignored(key, f"{pure}: true decides the precision")
        return
    bf16, fp16 = build.raw.get("bf16"), build.raw.get("fp16")
    if key == "fp16" and bf16 not in (None, False):
        if value:
            build.refused(key, "bf16 and fp16 are both set; keep one")
        else:
            build.ignored(key, "false: bf16 decides the precision")
        return
    if key == "fp16":
        build.put(key, "train.precision", "fp16" if value else "fp32")
    elif value == "auto":
        build.put(key, "train.precision", "auto", "bf16 where the device supports it")
    elif value:
        build.put(key, "train.precision", "bf16")
    elif fp16:
        build.ignored(key, "false: fp16 decides the precision")
    else:
        build.put(key, "train.precision", "fp32", "neither bf16 nor fp16")


def _pure_half(build: Build, key: str, value) -> None:
    """Their non-AMP bfloat16 / float16: the weights themselves in that dtype."""
    other = "float16" if key == "bfloat16" else "bfloat16"
    if not value:
        build.ignored(key, "false: bf16 and fp16 decide the precision")
    elif build.raw.get(other):
        build.refused(key, f"{key} and {other} are both set; keep one")
    else:
        dtype, precision = ("bfloat16", "bf16") if key == "bfloat16" else ("float16", "fp16")
        build.set("train.precision", precision)
        why = f"the weights are stored and trained in {dtype}, no float32 copy, and train.precision = {precision}"
        build.put(key, "model.dtype", dtype, why)


def _checkpointing(build: Build, key: str, value) -> None:
    if value is True and offloads_activations(build.raw):
        build.put(key, "train.gradient_checkpointing", "offload", "with activation_offloading")
    elif value in (True, False, "offload"):
        build.put(key, "train.gradient_checkpointing", value)
    else:
        build.refused(key, f"{value!r}: keel's choices are true, false and offload")


def _attention(build: Build, key: str, value) -> None:
    name = value if key == "attn_implementation" else key
    if key != "attn_implementation" and not value:
        build.ignored(key, "false: another attention setting (or keel's auto) decides")
    elif name in _ATTENTION:
        target, why = _ATTENTION[name]
        build.put(key, "model.attn_implementation", target, why)
    else:
        build.refused(
            key, f"{name!r}: keel's attention choices are auto, sdpa, eager and flash_attention_2"
        )


def _packing(build: Build, key: str, value) -> None:
    if value and build.stage == "grpo":
        build.ignored(key, "grpo trains on generated completions; prompt rows are never packed")
    else:
        build.put(key, "data.packing", bool(value))


def _betas(build: Build, key: str, value) -> None:
    betas = [
        yaml_number(str(build.raw.get("adam_beta1", 0.9))),
        yaml_number(str(build.raw.get("adam_beta2", 0.999))),
    ]
    build.put(key, "train.adam_betas", betas)


def _steps(build: Build, key: str, value) -> None:
    target = "output.save_every" if key == "save_steps" else "train.eval_every"
    if value is None:
        build.ignored(key, "empty: Axolotl's default")
    elif isinstance(value, int):
        build.put(key, target, value)
    else:
        build.refused(key, f"{value!r}: keel counts {target} in whole steps")


def _loggers(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "false: not this logger")
        return
    logger = "tensorboard" if key == "use_tensorboard" else "wandb"
    _add_logger(build, logger)
    build.mapped(key, "output.loggers", f"jsonl and {logger}")


def _wandb(build: Build, key: str, value) -> None:
    """A W&B project turns W&B logging on in Axolotl (use_wandb is implied)."""
    if value is None:
        build.ignored(key, "empty: no W&B logging")
        return
    build.put(key, DIRECT[key], value, "and wandb joins output.loggers")
    _add_logger(build, "wandb")


def _add_logger(build: Build, logger: str) -> None:
    loggers = build.config.setdefault("output", {}).setdefault("loggers", ["jsonl"])
    if logger not in loggers:
        loggers.append(logger)


def _auto_resume(build: Build, key: str, value) -> None:
    if value:
        build.put(key, "train.resume", "auto", "the newest complete checkpoint in output.dir")
    else:
        build.ignored(key, "false: resume_from_checkpoint decides")


def _datasets(build: Build, key: str, value) -> None:
    translate_datasets(build, value, key)


def _defaults(build: Build) -> None:
    """Axolotl's defaults where they differ from keel's, written out and noted."""
    raw = build.raw
    if "adapter" not in raw and not raw.get("unfrozen_parameters"):
        build.kept("method.type", "full", "no adapter: Axolotl trains every weight")
        if raw.get("processor_type") and "freeze_mm_modules" not in raw:  # multimodal
            why = "Axolotl's full fine-tuning trains a vision-language model's tower too"
            build.kept("model.vision.freeze_tower", False, why)
            build.kept("model.vision.freeze_projector", False, why)
    if raw.get("output_dir") is None:
        build.kept("output.dir", "./model-out", "Axolotl's default output_dir")
    if "datasets" not in raw and "pretraining_dataset" not in raw:
        build.set("data.datasets", [])  # keel reports the empty list with its fix
    stage_defaults(build)
    if raw.get("sequence_len") is None:
        build.kept("data.cutoff_len", 512, "Axolotl's default sequence_len")
    if raw.get("adapter") in ("lora", "qlora") and raw.get("lora_dropout") is None:
        build.kept("method.lora.dropout", 0.0, "Axolotl's default lora_dropout")
    for key in ("lora_r", "lora_alpha"):
        if key not in raw:
            _lora_size(build, key, None, "left out")


def _lora_size(build: Build, key: str, value, empty: str = "empty") -> None:
    """lora_r and lora_alpha have no default: Axolotl hands PEFT what the config holds, and
    with an adapter an empty one stops its run when the adapter is made."""
    if value is not None:
        build.put(key, DIRECT[key], yaml_number(value) if isinstance(value, str) else value)
    elif build.raw.get("adapter") in ("lora", "qlora"):
        example = "16" if key == "lora_r" else "2 x lora_r"
        why = (
            f"{empty}: Axolotl has no default for it (its LoRA run stops); set it (e.g. {example})"
        )
        build.refused(key, why)
    elif empty == "empty":
        build.ignored(key, "empty: read with adapter lora or qlora only")


_HANDLERS = {
    **TRAINING_HANDLERS,
    **QAT_HANDLERS,
    "adapter": _adapter,
    "load_in_4bit": _load_in_4bit,
    "load_in_8bit": _load_in_8bit,
    "lora_target_linear": _targets,
    "lora_target_modules": _targets,
    "lora_model_dir": _lora_model_dir,
    "lora_r": _lora_size,
    "lora_alpha": _lora_size,
    "optimizer": optimizer,
    "lr_scheduler": scheduler,
    "bf16": _precision,
    "fp16": _precision,
    "bfloat16": _pure_half,
    "float16": _pure_half,
    "gradient_checkpointing": _checkpointing,
    "attn_implementation": _attention,
    "flash_attention": _attention,
    "sdp_attention": _attention,
    "eager_attention": _attention,
    "sample_packing": _packing,
    "adam_beta1": _betas,
    "adam_beta2": _betas,
    "save_steps": _steps,
    "eval_steps": _steps,
    "use_wandb": _loggers,
    "use_tensorboard": _loggers,
    "wandb_project": _wandb,
    "auto_resume_from_checkpoints": _auto_resume,
    "chat_template": axolotl_chat_template,
    "chat_template_jinja": axolotl_chat_template_jinja,
    "special_tokens": special_tokens,
    "tokenizer_use_mistral_common": mistral_common,
    "tokens": added_tokens,
    "datasets": _datasets,
    "test_datasets": _datasets,
    "min_sample_len": min_sample_len,
    "save_strategy": save_strategy,
    "eval_strategy": eval_strategy,
    "evaluation_strategy": eval_strategy,
    **RUNTIME_HANDLERS,
    **TOKEN_WEIGHTING_HANDLERS,
    **STREAMING_HANDLERS,
}
# Keys whose null has a meaning of its own (no adapter: full fine-tuning; no datasets: the
# fix to name some; no LoRA rank: their LoRA run stops); any other known key left empty is
# Axolotl's default.
_NULL_MEANS_SOMETHING = ("adapter", "datasets", "bf16", "fp16", "lora_r", "lora_alpha")
_KNOWN = (*_HANDLERS, *DIRECT, *IGNORED, *STAGE_KEYS)
