"""keel's LoRA and OFT settings as PEFT configs: which modules are wrapped (all-linear
spelled out on a mixture of experts, a vision-language model's tower and projector left
out), which train in full beside the adapter, and the wrapping itself."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from keel.config.schema import LoraConfig, OftConfig, VisionConfig
from keel.models.experts import (
    check_no_wrapped_experts,
    fused_experts,
    linear_targets,
    retargeted_names,
)
from keel.models.trainable import matches
from keel.models.vision_parts import lora_exclusions, modules_to_save, vision_family

Log = Callable[[str], None]


def adapter_targets(settings: LoraConfig | OftConfig) -> str | list[str]:
    # A single name is a list of one; PEFT would read a bare string as a regular expression.
    targets = settings.targets
    return [targets] if isinstance(targets, str) and targets != "all-linear" else targets


def full_modules(model, settings: LoraConfig | OftConfig, log: Log) -> tuple[list[str], bool]:
    """(PEFT modules_to_save entries, whether they tie the output layer to the embeddings)
    for the adapter's modules_to_save. With tied input and output embeddings, naming either
    trains the one shared matrix: both are listed and PEFT keeps their copies tied (else the
    saved model would tie them back, dropping the output layer's training)."""
    wanted = list(settings.modules_to_save)
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or inputs.weight is not outputs.weight:
        return wanted, False
    tied = {name: m for name, m in model.named_modules() if m is inputs or m is outputs}
    named = [n for n in tied if any(matches(n, entry) for entry in wanted)]
    if not named:
        return wanted, False
    missing = [n.rsplit(".", 1)[-1] for n in tied if n not in named]
    if missing:
        log(
            f"note: {', '.join(missing)} and {named[0].rsplit('.', 1)[-1]} share one weight "
            f"here, so both train (modules_to_save)"
        )
    short = [n.rsplit(".", 1)[-1] for n in tied]
    return wanted + [name for name in short if name not in wanted], True


@dataclass(frozen=True)
class _Wrapping:
    """What PEFT's LoRA and OFT configs both take from keel's settings."""

    targets: str | list[str]  # target_modules
    full: list[str]  # modules_to_save: a VLM's training tower/projector, then the config's
    tied: bool  # they name embeddings tied to the output layer
    settings: dict  # exclude_modules: a VLM's tower and projector


def _wrapping(model, settings, log: Log, *, vision: VisionConfig, moe_note) -> _Wrapping:
    """The target modules (all-linear spelled out as the linear modules with LoRA's layers,
    and on a mixture of experts, whose expert and router names PEFT would read as targets;
    `moe_note`: (the adapter's name, what trains the experts instead) to log that, or
    None), the modules trained in full and a vision-language model's exclusions."""
    family = vision_family(model)
    full, tied = full_modules(model, settings, log)
    targets = adapter_targets(settings)
    if targets == "all-linear" and getattr(settings, "layers", None):
        targets = linear_targets(model)  # PEFT takes layers_to_transform with a list only
    elif targets == "all-linear" and retargeted_names(model):
        targets = linear_targets(model)
        if moe_note is not None:
            name, instead = moe_note
            log(
                f"note: {type(model).__name__} is a mixture of experts: {name} adapts its "
                f"linear modules, not its routed experts ({', '.join(fused_experts(model))}) "
                f"or router; {instead} trains them"
            )
    extra = {}
    if family is not None:
        extra["exclude_modules"] = lora_exclusions(family)
        full = modules_to_save(model, family, vision) + full
    return _Wrapping(targets, full, tied, extra)


def wrap_lora(model, lora: LoraConfig, log: Log, *, vision: VisionConfig):
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    advice = "method.lora.target_parameters adapts the experts, method.type full or freeze"
    wrap = _wrapping(
        model,
        lora,
        log,
        vision=vision,
        moe_note=None if lora.target_parameters else ("LoRA", advice),
    )
    targets, full, tied, settings = wrap.targets, wrap.full, wrap.tied, wrap.settings
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        use_rslora=lora.rslora,
        use_dora=lora.dora,
        modules_to_save=full or None,
        ensure_weight_tying=tied,
        task_type=TaskType.CAUSAL_LM,
        target_parameters=lora.target_parameters or None,
        layers_to_transform=lora.layers or None,
        **settings,
    )
    peft_model = get_peft_model(model, peft_config)
    check_no_wrapped_experts(peft_model, lora.target_parameters)
    # Short names of the wrapped modules keep the log one line (PEFT's expanded target list
    # also names modules its exclude_modules then skipped: a vision tower's).
    wrapped = {
        n.rsplit(".", 1)[-1]
        for n, m in peft_model.named_modules()
        if hasattr(m, "lora_A") and not hasattr(m, "parameter_name")
    } | set(lora.target_parameters)  # the fused experts' weights, as named
    scale = (
        f" (rsLoRA: scale alpha/sqrt(r) = {lora.alpha / lora.r**0.5:.3g})" if lora.rslora else ""
    )
    in_full = (
        f"; trained in full: {', '.join(lora.modules_to_save)}" if lora.modules_to_save else ""
    )
    where = f" of decoder layers {', '.join(map(str, lora.layers))}" if lora.layers else ""
    log(
        f"LoRA r={lora.r} alpha={lora.alpha}{scale} on: {', '.join(sorted(wrapped))}{where}"
        f"{in_full}"
    )
    return peft_model


def wrap_oft(model, oft: OftConfig, log: Log, *, vision: VisionConfig):
    from peft import OFTConfig, TaskType, get_peft_model

    # tied embeddings in modules_to_save are refused by method_problems: PEFT's OFT has no
    # ensure_weight_tying
    wrap = _wrapping(model, oft, log, vision=vision, moe_note=("OFT", "method.type full or freeze"))
    peft_config = OFTConfig(
        oft_block_size=oft.block_size,
        r=0,  # the blocks per layer follow from the block size
        target_modules=wrap.targets,
        use_cayley_neumann=oft.cayley_neumann,
        modules_to_save=wrap.full or None,
        task_type=TaskType.CAUSAL_LM,
        **wrap.settings,
    )
    with warnings.catch_warnings():  # PEFT warns per layer whose inputs need another size
        warnings.filterwarnings("ignore", message="Invalid `oft_block_size`")
        peft_model = get_peft_model(model, peft_config)
    wrapped, other_sizes = set(), {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "oft_R") and "default" in module.oft_R:
            short = name.rsplit(".", 1)[-1]
            wrapped.add(short)
            size = module.oft_block_size["default"]
            if size != oft.block_size:
                other_sizes[short] = (module.in_features, size)
    in_full = f"; trained in full: {', '.join(oft.modules_to_save)}" if oft.modules_to_save else ""
    log(f"OFT block_size={oft.block_size} on: {', '.join(sorted(wrapped))}{in_full}")
    if other_sizes:
        log(
            f"note: method.oft.block_size {oft.block_size} does not divide the inputs of "
            + ", ".join(f"{n} ({d}: blocks of {b})" for n, (d, b) in sorted(other_sizes.items()))
            + "; those layers use the nearest size that does (PEFT's rule)"
        )
    return peft_model
