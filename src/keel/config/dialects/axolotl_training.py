"""Axolotl's keys for the schedule's floor, the data's order and copies, and what SFT rows
train on, as keel keys; and how their YAML's numbers are read."""

from __future__ import annotations

import math
import re

from keel.config.dialects.build import Build, scheduler_kwargs

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")  # YAML 1.1 reads 2e-5 as text


def yaml_number(value: str):
    """`value` as a float where it spells one (YAML 1.1 reads `2e-5` as text), else as is."""
    return float(value) if _NUMBER.match(value.strip()) else value


def _scheduler_kwargs(build: Build, key: str, value) -> None:
    lr = build.raw.get("learning_rate")
    lr = yaml_number(lr) if isinstance(lr, str) else lr
    scheduler_kwargs(build, key, value, lr=lr, scheduler_key="lr_scheduler")


def _cosine_min_lr_ratio(build: Build, key: str, value) -> None:
    if build.raw.get("lr_scheduler") in (None, "cosine"):  # their default is cosine
        build.put(key, "train.min_lr_ratio", value)
    else:
        build.ignored(key, "Axolotl reads it with lr_scheduler: cosine only")


def _deduplication(build: Build, key: str, value) -> None:
    why = "keel compares the prepared samples (their tokens and what trains), not the raw rows"
    build.put(key, "data.deduplicate", bool(value), why if value else "")


def _shuffle_merged(build: Build, key: str, value) -> None:
    if build.raw.get("curriculum_sampling"):
        build.ignored(key, "read with curriculum_sampling (which see)")
    else:
        why = "their sampler draws the rows in a new random order each epoch either way, as keel"
        build.ignored(key, why + " does (data.shuffle)")


def _curriculum(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(
            key, "false: the rows in a new random order each epoch, as keel's data.shuffle"
        )
    elif build.raw.get("shuffle_merged_datasets", True):
        build.refused(
            key,
            "true with shuffle_merged_datasets (their default): one shuffle, then that order "
            "every epoch; keel shuffles every epoch (data.shuffle: true) or keeps the files' "
            "order (false): set shuffle_merged_datasets: false to keep it",
        )
    else:
        build.put(key, "data.shuffle", False, "the files' order, every epoch")


def _train_on_inputs(build: Build, key: str, value) -> None:
    if build.stage in (None, "sft"):
        build.put(key, "data.train_on_prompt", bool(value))
    else:  # their preference, KTO, GRPO and completion data ignore it
        build.ignored(key, f"Axolotl's {build.stage} data does not read it, nor does keel's")


# Their pattern syntax (axolotl.utils.freeze.LayerNamePattern): a trailing [start:end] picks
# rows of the parameter, and a dot is literal unless a + follows it.
_ROW_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")
_LITERAL_DOT = re.compile(r"\.(?!\+)")


def _unfrozen_parameters(build: Build, key: str, value) -> None:
    patterns = [value] if isinstance(value, str) else value
    if not patterns:
        build.ignored(key, "empty: the adapter setting decides what trains")
    elif build.raw.get("adapter") in ("lora", "qlora"):
        build.refused(
            key,
            "with an adapter keel trains the LoRA adapters and lora_modules_to_save only: "
            "list modules to train in full under lora_modules_to_save (keel's LoRA adapts a "
            "vision-language model's language model only, its vision tower stays frozen)",
        )
    elif not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        build.refused(key, f"{value!r}: a list of regular expressions over parameter names")
    elif ranged := [p for p in patterns if _ROW_RANGE.match(p)]:
        build.refused(
            key,
            f"{', '.join(ranged)}: keel trains whole parameters, not ranges of their rows; "
            f"remove the [start:end] (the whole parameter trains) or the pattern",
        )
    else:
        build.set("method.type", "freeze")
        build.set("method.freeze.trainable_layers", 0)
        why = (
            "method freeze trains only the parameters these match from the start of their "
            "names; a dot is literal unless a + follows it, as Axolotl reads them"
        )
        keel_patterns = [_LITERAL_DOT.sub(r"\\.", p) for p in patterns]
        build.put(key, "method.freeze.trainable_params", keel_patterns, why)


def _freeze_mm_modules(build: Build, key: str, value) -> None:
    """Their switch that freezes a multimodal model's encoders and projectors; without it
    their full fine-tuning trains them, and LoRA adapts what lora_target_modules names."""
    if value:
        build.set("model.vision.freeze_projector", True)
        build.put(key, "model.vision.freeze_tower", True, "and model.vision.freeze_projector")
    elif build.raw.get("adapter") in ("lora", "qlora"):
        build.ignored(key, "keel's LoRA adapts a vision-language model's language model only")
    else:
        build.set("model.vision.freeze_projector", False)
        why = "and model.vision.freeze_projector: full fine-tuning trains them, as theirs does"
        build.put(key, "model.vision.freeze_tower", False, why)


def _model_config(build: Build, key: str, value) -> None:
    """Their overrides of the model's config.json: the router's balance loss is a training
    setting keel has (train.router_aux_loss_coef); any other override is refused."""
    if not build.mapping(
        key, value, empty="empty: the model's own config", what="a mapping of config.json keys"
    ):
        return
    balance = value.get("output_router_logits")
    for name, setting in value.items():
        dotted = f"{key}.{name}"
        if name == "output_router_logits" and setting:
            coef = value.get("router_aux_loss_coef", "model")
            why = "the routers' load-balancing loss, weighted by " + (
                "the model config's router_aux_loss_coef"
                if coef == "model"
                else "their coefficient"
            )
            build.put(dotted, "train.router_aux_loss_coef", coef, why)
        elif name == "output_router_logits":
            build.ignored(dotted, "false: no balance loss, keel's default")
        elif name == "router_aux_loss_coef":
            if balance:
                build.mapped(dotted, "train.router_aux_loss_coef")
            else:
                build.ignored(dotted, "used only with output_router_logits: true")
        else:
            build.refused(
                dotted,
                "keel trains the model as its config.json describes it; change that file "
                "(a copy of the model folder) instead",
            )


# Axolotl's choices for computing a mixture of experts' fused experts: transformers' own
# (eager, batched_mm, grouped_mm) and the Hub kernels' (scattermoe, sonicmoe, which their
# use_scattermoe / use_sonicmoe switch on). Each computes the same experts; they differ in
# speed and memory on their GPUs.
_EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager", "scattermoe", "sonicmoe")


def _experts_implementation(build: Build, key: str, value) -> None:
    """How a mixture of experts' fused experts are computed: keel keeps transformers'
    default, grouped matmuls (eager where torch cannot run them)."""
    if value is None or value in _EXPERTS_IMPLEMENTATIONS:
        why = "computes the same experts as transformers' default, grouped_mm, which keel runs"
        build.ignored(key, f"{value}: {why}")
    else:
        known = ", ".join(_EXPERTS_IMPLEMENTATIONS)
        build.refused(key, f"{value!r}: not one of Axolotl's implementations ({known})")


def _moe_experts_only(build: Build, key: str, value) -> None:
    """What Axolotl does to a mixture of experts' fused experts that keel does not."""
    if key == "quantize_moe_experts" and value and build.raw.get("adapter") == "qlora":
        build.put(key, "method.qlora.quantize_experts", True, "NF4 experts beside NF4 linears")
        return
    if key == "lora_target_parameters" and value and build.raw.get("adapter"):
        names = [value] if isinstance(value, str) else value
        build.put(key, "method.lora.target_parameters", names, "rank lora_r per expert")
        return
    whys = {
        "quantize_moe_experts": "keel stores experts in NF4 under QLoRA only (adapter: qlora, "
        "load_in_4bit); with another adapter they stay in model.dtype (keel plan counts them "
        "there): remove it, or use adapter: qlora",
        "lora_target_parameters": "LoRA on parameters without an adapter: set adapter: lora "
        "(or qlora)",
    }
    if not value:
        build.ignored(key, f"{value!r}: off")
    else:
        build.refused(key, whys[key])


def _batch_size(build: Build, key: str, value) -> None:
    """Their older spelling of a process's batch: gradient_accumulation_steps is
    batch_size // micro_batch_size when they leave it out (their normalize_config)."""
    micro = build.raw.get("micro_batch_size") or 1
    if build.raw.get("gradient_accumulation_steps"):
        build.ignored(key, "gradient_accumulation_steps is set, which Axolotl takes then")
    elif not isinstance(value, int) or value < micro:
        build.refused(key, f"{value!r}: a whole number of rows, at least micro_batch_size")
    else:
        why = f"batch_size // micro_batch_size = {value} // {micro}, as Axolotl computes it"
        build.put(key, "train.grad_accum", value // micro, why)


def _fan_in_fan_out(build: Build, key: str, value) -> None:
    build.ignored(
        key,
        f"{value!r}: PEFT decides it from the layer (true for GPT-2's Conv1D, false for "
        f"Linear), whatever is set",
    )


def _lora_init(build: Build, key: str, value) -> None:
    """peft_init_lora_weights, which Axolotl hands PEFT's init_lora_weights as it is."""
    if value is None or value is True:
        build.ignored(key, f"{value}: LoRA's usual start (A random, B zero)")
    elif value in ("gaussian", "olora"):
        build.put(key, "method.lora.init", value)
    elif value == "pissa":
        build.set("method.lora.pissa_iters", 0)
        build.put(key, "method.lora.init", value, "method.lora.pissa_iters 0: the exact SVD")
    elif isinstance(value, str) and value.startswith("pissa_niter_"):
        iters = value.removeprefix("pissa_niter_")
        if not iters.isdigit():
            build.refused(key, f"{value!r}: pissa_niter_ takes a number of iterations")
            return
        build.set("method.lora.pissa_iters", int(iters))
        build.put(key, "method.lora.init", "pissa", f"method.lora.pissa_iters {iters}")
    else:
        build.refused(
            key,
            f"{value!r}: keel starts LoRA as PEFT's default (true), gaussian, pissa, "
            "pissa_niter_<n> or olora (method.lora.init)",
        )


def _lora_layers(build: Build, key: str, value) -> None:
    """peft_layers_to_transform (the decoder layers LoRA adapts) and peft_layers_pattern (the
    name of their module list, which PEFT finds itself when it is `layers`)."""
    if value is None or value == []:
        build.ignored(key, "empty: every layer")
    elif key == "peft_layers_to_transform":
        layers = [value] if isinstance(value, int) else value
        build.put(key, "method.lora.layers", layers)
    elif value in ("layers", ["layers"]):
        build.ignored(key, f"{value!r}: PEFT finds the decoder layers under `layers` itself")
    else:
        build.refused(key, f"{value!r}: keel adapts the layers of the model's `layers` list")


_PER_EPOCH = {
    "saves_per_epoch": ("output.saves_per_epoch", "output.save_every", "saves"),
    "evals_per_epoch": ("train.evals_per_epoch", "train.eval_every", "evaluates"),
}


def _per_epoch(build: Build, key: str, value) -> None:
    """Their saves_per_epoch / evals_per_epoch N become save_steps / eval_steps of
    1 / (N x num_epochs): a fraction of the run's steps, as Hugging Face reads one under 1.
    Without max_steps that is N times an epoch, keel's own count; with max_steps it is of
    max_steps, so it becomes every ceil(max_steps / (N x num_epochs)) steps."""
    per_epoch, every, does = _PER_EPOCH[key]
    raw = build.raw
    value, max_steps, epochs = (
        yaml_number(x) if isinstance(x, str) else x
        for x in (value, raw.get("max_steps"), raw.get("num_epochs") or 1)
    )
    numbers = all(isinstance(x, int | float) for x in (value, max_steps, epochs))
    fraction = 1 / (value * epochs) if numbers and value and epochs else None
    streamed = bool(raw.get("streaming") or raw.get("pretraining_dataset"))
    if max_steps and fraction is not None and fraction < 1:
        steps = math.ceil(max_steps * fraction)
        why = f"1/({value} x num_epochs) of max_steps {max_steps}, as Hugging Face reads it"
        build.put(key, every, steps, why)
    elif streamed and value:
        why = (
            f"once an epoch, and streamed data's epoch has no known length: keel {does} at the end"
        )
        build.ignored(key, why)
    else:
        build.put(key, per_epoch, value)


TRAINING_HANDLERS = {
    **{key: _per_epoch for key in _PER_EPOCH},
    "batch_size": _batch_size,
    "lora_fan_in_fan_out": _fan_in_fan_out,
    "peft_init_lora_weights": _lora_init,
    "peft_layers_to_transform": _lora_layers,
    "peft_layers_pattern": _lora_layers,
    "model_config": _model_config,
    "quantize_moe_experts": _moe_experts_only,
    "lora_target_parameters": _moe_experts_only,
    "experts_implementation": _experts_implementation,
    "unfrozen_parameters": _unfrozen_parameters,
    "freeze_mm_modules": _freeze_mm_modules,
    "lr_scheduler_kwargs": _scheduler_kwargs,
    "cosine_min_lr_ratio": _cosine_min_lr_ratio,
    "dataset_exact_deduplication": _deduplication,
    "shuffle_merged_datasets": _shuffle_merged,
    "curriculum_sampling": _curriculum,
    "train_on_inputs": _train_on_inputs,
}
