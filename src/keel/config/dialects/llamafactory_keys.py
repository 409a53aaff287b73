"""The rules for LLaMA-Factory's model, method and simple one-to-one keys (meanings from its
hparams dataclasses and the Hugging Face training arguments it extends): map the key to keel
keys, ignore it saying why, or refuse it saying why."""

from __future__ import annotations

from collections.abc import Callable

from keel.config.dialects.build import Build, scheduler_kwargs, streaming
from keel.config.dialects.templates import llamafactory_template


def keel_stage(raw: dict) -> str | None:
    """keel's stage for their stage (+ pref_loss), None where keel has none."""
    stage = raw.get("stage", "sft")
    if stage == "dpo":
        return {"orpo": "orpo", "simpo": "simpo"}.get(raw.get("pref_loss"), "dpo")
    return stage if stage in ("pt", "sft", "rm", "kto") else None


Rule = Callable[[Build, str, object], None]

_DIRECT = {
    "model_name_or_path": "model.path",
    "trust_remote_code": "model.trust_remote_code",
    "model_revision": "model.revision",
    "image_max_pixels": "model.vision.image_max_pixels",
    "image_min_pixels": "model.vision.image_min_pixels",
    "freeze_vision_tower": "model.vision.freeze_tower",
    "freeze_multi_modal_projector": "model.vision.freeze_projector",
    "lora_dropout": "method.lora.dropout",
    "use_rslora": "method.lora.rslora",
    "use_dora": "method.lora.dora",
    "loraplus_lr_ratio": "method.lora.plus_lr_ratio",
    "cutoff_len": "data.cutoff_len",
    "val_size": "data.val_size",
    "preprocessing_num_workers": "data.num_proc",
    "output_dir": "output.dir",
    "overwrite_output_dir": "output.overwrite",
    "logging_steps": "output.log_every",
    "save_steps": "output.save_every",
    "save_total_limit": "output.keep_last",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "learning_rate": "train.lr",
    "num_train_epochs": "train.epochs",
    "warmup_ratio": "train.warmup_ratio",
    "warmup_steps": "train.warmup_steps",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "seed": "train.seed",
    "adam_epsilon": "train.adam_eps",
    "eval_steps": "train.eval_every",
}

_IGNORED = {
    "loraplus_lr_embedding": "keel's LoRA+ trains every LoRA B matrix at loraplus_lr_ratio, "
    "embedding layers' too; this lr is theirs for LoRA on embedding layers, which "
    "`lora_target: all` does not adapt",
    "plot_loss": "keel writes the loss to metrics.jsonl in output.dir every output.log_every "
    "steps; plot it from there",
    "dataloader_num_workers": "keel tokenizes before training and builds batches in the "
    "training process; there are no loader workers",
    "ddp_timeout": "keel's watchdog reports a hang after watchdog.hang_timeout_s seconds "
    "(120 by default) and distributed.timeout_s fails a stuck collective, so a timeout of "
    "days is not needed",
    "save_only_model": "keel's checkpoints always hold the optimizer and data state, so a "
    "resumed run continues exactly; the final model is saved in Hugging Face format",
    "per_device_eval_batch_size": "keel evaluates with train.micro_batch_size",
    "include_num_input_tokens_seen": "keel logs each step's tokens (tokens_per_s) and the "
    "run's real_tokens in keel_run.json",
    "overwrite_cache": "keel keeps no LLaMA-Factory dataset cache to overwrite",
    "tokenized_path": "keel tokenizes the datasets as part of the run; it neither writes nor "
    "reads a tokenized copy",
    "video_max_pixels": "keel's vision-language data holds images only",
    "video_min_pixels": "keel's vision-language data holds images only",
    "video_fps": "keel's vision-language data holds images only (a row with a video is "
    "refused, naming it)",
    "video_maxlen": "keel's vision-language data holds images only (a row with a video is "
    "refused, naming it)",
    "double_quantization": "keel's NF4 base (torchao) quantises the block scales as well",
    "compute_accuracy": "keel's evaluation reports the loss",
    "ddp_find_unused_parameters": "keel's DDP wraps only the weights that train",
    "enable_liger_kernel": "keel computes the output layer and cross-entropy in chunks itself "
    "(train.loss_chunk_size)",
    "use_unsloth": "keel uses its own training step; Unsloth's patches are not applied",
    "use_v1_kernels": "LLaMA-Factory's fused kernels for Ascend NPUs (MoE, RMSNorm, RoPE, "
    "SwiGLU; on other devices it applies none) compute the same math; keel uses PyTorch's "
    "own operations",
    "use_reentrant_gc": "keel's activation checkpointing is non-reentrant (no setting)",
    "gradient_checkpointing_kwargs": "keel's activation checkpointing is non-reentrant and "
    "takes no options",
}

# Feature switches keel has no counterpart for: off is keel's behaviour, on is refused.
_SWITCHES = {
    "use_galore": "GaLore is not available",
    "use_badam": "BAdam is not available",
    "use_apollo": "APOLLO is not available",
    "use_adam_mini": "Adam-mini is not available; train.optimizer is adamw, adamw_8bit, "
    "adamw_4bit or muon",
    "freeze_language_model": "keel trains the language model",
    "do_predict": "keel train does not predict: keel predict takes this file as it is",
    "use_asft_loss": "ASFT (DFT plus a KL term to a reference model's next-token "
    "distributions) is not available; use_dft_loss is",
}


def _direct(build: Build, key: str, value) -> None:
    if value is None:
        build.ignored(key, "null: keel's default")
    elif key == "save_steps" and isinstance(value, float) and value < 1:
        build.refused(key, f"{value}: a fraction of the run; keel saves every N steps")
    else:
        build.put(key, _DIRECT.get(key, "method.freeze.trainable_layers"), value)


def _sft_masking(build: Build, key: str, value) -> None:
    """train_on_prompt and mask_history: what their supervised data trains on."""
    if build.stage in (None, "sft"):
        build.put(key, f"data.{key}", bool(value))
    elif value:
        build.refused(key, f"true outside sft: their {build.stage} run stops (sft only)")
    else:
        build.ignored(key, "false")


def _scheduler_kwargs(build: Build, key: str, value) -> None:
    lr = build.raw.get("learning_rate", 5e-5)  # HF's default
    scheduler_kwargs(build, key, value, lr=lr, scheduler_key="lr_scheduler_type")


def _switch(build: Build, key: str, value) -> None:
    if key == "do_predict" or value:
        build.refused(key, _SWITCHES[key]) if value else build.ignored(key, "false")
    else:
        build.ignored(key, f"false: {_SWITCHES[key]}")


def _stage(build: Build, key: str, value) -> None:
    stage = build.stage
    if stage is None:
        why = "keel's stages are pt, sft, rm, dpo, orpo, simpo, kto and grpo"
        if value == "ppo":
            why = "PPO is not available; keel's online RL stage is grpo (train.stage grpo)"
        build.refused(key, why)
        return
    build.put(key, "train.stage", stage)


def _pref_loss(build: Build, key: str, value) -> None:
    if value in ("orpo", "simpo"):
        build.mapped(key, "train.stage", f"keel's {value} stage")
    elif value in ("sigmoid", "hinge", "ipo") and build.stage == "dpo":
        build.put(key, "dpo.loss_type", value)
    elif value in ("sigmoid", "hinge", "ipo"):
        build.ignored(key, f"read by stage dpo only (this is {build.stage})")
    else:
        build.refused(
            key, f"{value}: keel's preference losses are sigmoid, hinge, ipo, orpo, simpo"
        )


_STAGE_KEYS = {  # their key -> (stages that read it, keel key under the stage's section)
    "pref_beta": (("dpo", "orpo", "simpo", "kto"), "beta"),
    "dpo_label_smoothing": (("dpo", "simpo"), "label_smoothing"),
    "simpo_gamma": (("simpo",), "gamma"),
    "kto_chosen_weight": (("kto",), "desirable_weight"),
    "kto_rejected_weight": (("kto",), "undesirable_weight"),
}


def _stage_setting(build: Build, key: str, value) -> None:
    stages, name = _STAGE_KEYS[key]
    if build.stage in stages:
        build.put(key, f"{build.stage}.{name}", value)
    else:
        build.ignored(key, f"read by stage {' and '.join(stages)} only (this is {build.stage})")


def _pref_ftx(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "0: no SFT term, as keel's dpo")
    else:
        why = "an SFT term beside the preference loss is not available (orpo has one built in)"
        build.refused(key, why)


def _finetuning_type(build: Build, key: str, value) -> None:
    if value not in ("lora", "full", "freeze", "oft"):
        build.refused(key, f"{value}: keel's methods are lora, qlora, oft, full and freeze")
    elif value == "lora" and build.raw.get("quantization_bit") == 4:
        build.put(key, "method.type", "qlora", "LoRA on a 4-bit base (quantization_bit: 4)")
    else:
        build.put(key, "method.type", value)


def _quantization(build: Build, key: str, value) -> None:
    lora = build.raw.get("finetuning_type", "lora") == "lora"
    if key == "quantization_bit":
        if value is None:
            build.ignored(key, "null: no quantisation")
        elif value == 4 and lora:
            build.mapped(key, "method.type", "qlora: an NF4 base under LoRA")
        else:
            build.refused(key, f"{value}: keel quantises the base to 4 bits (NF4) under LoRA only")
    elif key == "quantization_method":
        if value == "bnb":
            why = "NF4 as bitsandbytes stores it, through torchao (quant_backend bnb: itself)"
            build.put(key, "method.qlora.quant", "nf4", why)
        else:
            build.refused(key, f"{value}: keel's 4-bit base is NF4 (bitsandbytes or torchao)")
    elif value == "nf4":
        build.put(key, "method.qlora.quant", "nf4")
    else:
        build.refused(key, f"{value}: keel's 4-bit base is NF4 only")


def _lora_rank(build: Build, key: str, value) -> None:
    if value is not None:
        build.put(key, "method.lora.r", value)
    elif build.raw.get("finetuning_type", "lora") == "lora":
        # their alpha default (2 x rank) and PEFT both need a number: their run stops
        build.refused(key, "null: LoRA needs a rank; remove the key (their default 8) or set one")
    else:
        build.ignored(key, "null: read by finetuning_type lora only")


def _lora_alpha(build: Build, key: str, value) -> None:
    if not value:  # they take 0 as unset too
        build.ignored(key, f"{value}: 2 x lora_rank, written by the defaults below")
    else:
        build.put(key, "method.lora.alpha", value)


def _lora_target(build: Build, key: str, value) -> None:
    names = [name.strip() for name in str(value).split(",") if name.strip()]
    oft = build.raw.get("finetuning_type") == "oft"
    target = "method.oft.targets" if oft else "method.lora.targets"
    why = "; their OFT adapts lora_target's modules" if oft else ""
    if names == ["all"]:
        build.put(key, target, "all-linear", f"all: every linear layer{why}")
    else:
        build.put(key, target, names, why.removeprefix("; "))


def _llama_pro(build: Build, key: str, value) -> None:
    """use_llama_pro: their freeze tuning trains the last layer of each of
    freeze_trainable_layers groups, the blocks their scripts/llama_pro.py inserted."""
    method = build.raw.get("finetuning_type", "lora")
    if not value:
        build.ignored(key, "false: freeze trains the last freeze_trainable_layers layers")
    elif method == "freeze":
        why = "the last layer of each of freeze_trainable_layers groups trains"
        build.put(key, "method.freeze.expanded_blocks", True, why)
    else:
        build.refused(
            key,
            f"true with finetuning_type {method}: keel's LoRA on the expanded blocks alone is "
            "method.lora.layers with their indices (keel expand names them), which this "
            "translation cannot know without the model; set it, or use finetuning_type freeze",
        )


def _pissa(build: Build, key: str, value) -> None:
    """pissa_init, pissa_iter (-1: the exact SVD) and pissa_convert, as their LoRA reads them."""
    on = bool(build.raw.get("pissa_init"))
    if key == "pissa_init":
        if value:
            build.put(key, "method.lora.init", "pissa")
        else:
            build.ignored(key, "false: LoRA's usual start")
    elif not on:
        build.ignored(key, "read with pissa_init only")
    elif key == "pissa_iter":
        exact = value == -1
        why = "-1: the exact SVD" if exact else "randomised SVD iterations"
        build.put(key, "method.lora.pissa_iters", 0 if exact else value, why)
    elif value:
        why = (
            "keel always saves the converted adapter (a LoRA of rank 2r on the original base) "
            "as the output; their pissa_converted/ folder is that one"
        )
        build.ignored(key, f"true: {why}")
    else:
        why = (
            "keel saves the converted adapter (a LoRA of rank 2r on the original base) anyway; "
            "their output would be the PiSSA adapter, which only fits their residual base"
        )
        build.ignored(key, f"false: {why}")


def _oft(build: Build, key: str, value) -> None:
    """oft_block_size, oft_rank, oft_target and module_dropout, as their OFT reads them."""
    oft = build.raw.get("finetuning_type") == "oft"
    if key == "module_dropout":
        # PEFT's OFT layers build this dropout and never call it (peft 0.21)
        why = "PEFT's OFT builds the dropout but never applies it, so their runs train without it"
        build.ignored(key, f"{value}: {why}" if value else f"{value}: no dropout")
    elif not oft:
        build.ignored(key, "read by finetuning_type oft only")
    elif key == "oft_target":
        build.ignored(key, "their OFT adapts lora_target's modules and never reads oft_target")
    elif key == "oft_rank" and not value:
        build.ignored(key, f"{value}: the blocks per layer follow from oft_block_size")
    elif key == "oft_rank" or not value:
        build.refused(
            key,
            f"{value}: keel sizes OFT's blocks by oft_block_size only (a layer with d inputs "
            f"gets d / oft_block_size blocks); set oft_block_size (their default 32) and "
            f"remove oft_rank",
        )
    else:
        build.put(key, "method.oft.block_size", value)


def _freeze_modules(build: Build, key: str, value) -> None:
    names = [name.strip() for name in str(value or "").split(",") if name.strip()]
    if key == "freeze_extra_modules":
        if names:
            build.put(key, "method.freeze.trainable_modules", names)
        else:
            build.ignored(key, "empty")
    elif names == ["all"]:
        build.ignored(key, "all: keel trains every module of the trainable layers")
    else:
        build.refused(key, "keel trains whole layers; only `all` can be honoured")


def _additional_target(build: Build, key: str, value) -> None:
    names = [n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str) else value
    if not names:
        build.ignored(key, "empty")
    elif build.raw.get("finetuning_type", "lora") not in ("lora", "oft"):
        build.ignored(key, "read by finetuning_type lora and oft only")
    elif isinstance(names, list) and all(isinstance(n, str) for n in names):
        oft = build.raw.get("finetuning_type") == "oft"
        target = "method.oft.modules_to_save" if oft else "method.lora.modules_to_save"
        build.put(key, target, names, f"trained in full beside {'OFT' if oft else 'LoRA'}")
    else:
        build.refused(key, f"{value!r}: module names, comma-separated")


def _adapter_path(build: Build, key: str, value) -> None:
    paths = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else []
    if build.raw.get("finetuning_type", "lora") not in ("lora", "oft"):
        build.refused(key, "keel keeps training an adapter under finetuning_type lora or oft")
    elif len(paths) != 1 or build.raw.get("create_new_adapter"):
        build.refused(
            key,
            f"{value!r} with create_new_adapter {bool(build.raw.get('create_new_adapter'))}: "
            f"they merge adapters into the base first; keel keeps training one adapter "
            f"(model.adapter). Merge them into a model (keel export --model BASE --adapter "
            f"ADAPTER --out DIR) and name that as model_name_or_path",
        )
    else:
        build.put(key, "model.adapter", paths[0], "keeps training it (their resumed adapter)")


def _create_new_adapter(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "false: the adapter of adapter_name_or_path keeps training")
    elif not build.raw.get("adapter_name_or_path"):
        build.ignored(key, "true without adapter_name_or_path: new adapters, as keel trains")
    else:  # adapter_name_or_path says why it is refused
        build.ignored(key, "read with adapter_name_or_path")


def _flash_attn(build: Build, key: str, value) -> None:
    choices = {"auto": "auto", "sdpa": "sdpa", "fa2": "flash_attention_2", "disabled": "eager"}
    if value in choices:
        build.put(key, "model.attn_implementation", choices[value])
    else:
        build.refused(key, f"{value}: keel has auto, sdpa, fa2 (flash_attention_2), disabled")


def _ignore(build: Build, key: str, _value) -> None:
    build.ignored(key, _IGNORED[key])


def _streaming(build: Build, key: str, value) -> None:
    """Their streaming reads the datasets as training goes, shuffled through a buffer of
    buffer_size rows; keel's shuffles the files and each block of rows."""
    if key == "buffer_size":
        why = "data.streaming shuffles the files' order each epoch and the rows of each block"
        build.ignored(key, why if build.raw.get("streaming") else "used with streaming only")
    else:
        streaming(build, key, value)


def _shuffling(build: Build, key: str, value) -> None:
    """disable_shuffling: their trainer then reads the training set in order."""
    if value:
        build.put(key, "data.shuffle", False, "the training rows in order, every epoch")
    else:
        build.ignored(key, "false: keel's default (rows shuffled each epoch with train.seed)")


def _each_dataset(build: Build, key: str, value) -> None:
    """eval_on_each_dataset: a loss per eval dataset; keel logs one over them all."""
    why = "keel evaluates data.eval_datasets together and logs one eval_loss over them"
    build.ignored(key, why if value else "false: their default")


def _thinking(build: Build, key: str, value) -> None:
    """enable_thinking (their default true): false strips the reasoning from the answers."""
    if value is False:
        build.refused(
            key,
            "false strips each answer's reasoning before training; keel trains the "
            "reasoning the data holds (reasoning_content or thinking): remove it from the "
            "data, or leave the key out",
        )
    else:
        build.ignored(
            key, "true: their default (the answers' reasoning trains where the data has it)"
        )


def _mix(build: Build, key: str, value) -> None:
    """mix_strategy and interleave_probs: how their datasets are merged, as keel's data.mix
    draws the same rows (datasets.interleave_datasets with the run's seed)."""
    if key == "mix_strategy":
        if value == "concat":
            build.ignored(key, "concat: keel's default (every row of each dataset)")
        elif value in ("interleave_under", "interleave_over", "interleave_once"):
            build.put(key, "data.mix", value, "rows drawn from the datasets as theirs are")
        else:
            build.refused(
                key, f"{value!r}: their mixes are concat and interleave_under, _over, _once"
            )
        return
    if value is None:
        build.ignored(key, "empty: the datasets in turn")
        return
    parts = value if isinstance(value, list) else str(value).split(",")
    try:
        weights = [float(part) for part in parts]
    except (TypeError, ValueError):
        build.refused(key, f"{value!r}: probabilities, comma-separated")
        return
    build.put(key, "data.mix_weights", weights)


KEY_RULES: dict[str, Rule] = {
    **{key: _direct for key in _DIRECT},
    "freeze_trainable_layers": _direct,
    **{key: _switch for key in _SWITCHES},
    **{key: _stage_setting for key in _STAGE_KEYS},
    **{key: _ignore for key in _IGNORED},
    "streaming": _streaming,
    "buffer_size": _streaming,
    "mix_strategy": _mix,
    "disable_shuffling": _shuffling,
    "eval_on_each_dataset": _each_dataset,
    "enable_thinking": _thinking,
    "interleave_probs": _mix,
    "stage": _stage,
    "pref_loss": _pref_loss,
    "pref_ftx": _pref_ftx,
    "finetuning_type": _finetuning_type,
    "quantization_bit": _quantization,
    "quantization_method": _quantization,
    "quantization_type": _quantization,
    "lora_rank": _lora_rank,
    "lora_alpha": _lora_alpha,
    "lora_target": _lora_target,
    **{key: _oft for key in ("oft_block_size", "oft_rank", "oft_target", "module_dropout")},
    **{key: _pissa for key in ("pissa_init", "pissa_iter", "pissa_convert")},
    "use_llama_pro": _llama_pro,
    "freeze_trainable_modules": _freeze_modules,
    "freeze_extra_modules": _freeze_modules,
    "additional_target": _additional_target,
    "adapter_name_or_path": _adapter_path,
    "create_new_adapter": _create_new_adapter,
    "train_on_prompt": _sft_masking,
    "mask_history": _sft_masking,
    "lr_scheduler_kwargs": _scheduler_kwargs,
    "flash_attn": _flash_attn,
    "template": llamafactory_template,
}
