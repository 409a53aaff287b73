"""Rules of the method section (full, freeze, LoRA, QLoRA, OFT, QAT) beside its field types;
part of keel.config.validate. Returns problems, never raises."""

from __future__ import annotations

from keel.config.schema import RunConfig


def positive(value, key: str, *, allow_zero: bool = False) -> list[str]:
    """`key = value must be > 0` (or >= 0), or nothing when it is."""
    if value > 0 or (allow_zero and value == 0):
        return []
    bound = ">= 0" if allow_zero else "> 0"
    return [f"{key} = {value!r} must be {bound}"]


def check_method(cfg: RunConfig) -> list[str]:
    lora, freeze = cfg.method.lora, cfg.method.freeze
    problems = positive(lora.r, "method.lora.r") + positive(lora.alpha, "method.lora.alpha")
    if not 0 <= lora.dropout < 1:
        problems.append(f"method.lora.dropout = {lora.dropout} must be in [0, 1)")
    if lora.plus_lr_ratio is not None:
        problems += positive(lora.plus_lr_ratio, "method.lora.plus_lr_ratio")
    if cfg.method.type == "freeze" and freeze.trainable_layers >= 0:  # -N: the first N
        problems += positive(
            freeze.trainable_layers,
            "method.freeze.trainable_layers",
            allow_zero=bool(freeze.trainable_modules or freeze.trainable_params),
        )
    if cfg.method.type == "oft":
        problems += positive(cfg.method.oft.block_size, "method.oft.block_size")
    if cfg.output.merge_lora and not cfg.method.uses_adapter:
        problems.append(
            f"output.merge_lora = true needs method.type = lora, qlora or oft "
            f"(it is {cfg.method.type}); remove output.merge_lora"
        )
    if cfg.method.type == "qlora" and cfg.method.qlora.quant_backend == "bnb":
        if cfg.distributed.strategy == "fsdp":
            problems.append(BNB_UNDER_FSDP)
        if cfg.method.qlora.quantize_experts:
            problems.append(
                "method.qlora.quantize_experts = true stores experts as torchao's NF4 "
                "tensors; set method.qlora.quant_backend=torchao"
            )
    elif cfg.method.type == "qlora" and lora.dora:
        problems.append(DORA_ON_NF4)
    return problems + _check_expert_lora(cfg) + _check_split(cfg) + _check_qat(cfg)


def _check_split(cfg: RunConfig) -> list[str]:
    """PiSSA and OLoRA rewrite each adapted weight as (weight - a part of it) + the adapter's
    start: what would not hold that, refused."""
    lora = cfg.method.lora
    if lora.init not in ("pissa", "olora") or not cfg.method.uses_lora:
        return []
    key = f"method.lora.init = {lora.init}"
    problems = positive(lora.pissa_iters, "method.lora.pissa_iters", allow_zero=True)
    if cfg.method.type == "qlora":
        problems.append(
            f"{key} with method.type = qlora: the weight minus the adapter's part would be "
            "quantised again, and the saved adapter would not fit the 4-bit base; use "
            "method.type = lora, or method.lora.init = default"
        )
    if lora.dora:
        problems.append(
            f"{key} with method.lora.dora: DoRA's magnitudes are the base rows' norms, which "
            f"{lora.init} changes; use one of them"
        )
    if lora.target_parameters:
        problems.append(
            f"{key} with method.lora.target_parameters: the experts' fused weights are not "
            "decomposed; remove one of them"
        )
    if cfg.model.adapter:
        problems.append(
            f"{key} with model.adapter = {cfg.model.adapter}: the adapter's saved weights are "
            "where training starts, so there is nothing to initialise; remove method.lora.init"
        )
    return problems


def _check_expert_lora(cfg: RunConfig) -> list[str]:
    lora = cfg.method.lora
    if not lora.target_parameters or not cfg.method.uses_lora:
        return []
    key = f"method.lora.target_parameters = {lora.target_parameters}"
    problems = []
    if lora.dropout:
        problems.append(
            f"{key} with method.lora.dropout = {lora.dropout}: a weight's LoRA is added to the "
            f"weight, where no dropout of the input applies (PEFT refuses it); set dropout 0"
        )
    if lora.dora:
        problems.append(f"{key} with method.lora.dora: PEFT's DoRA adapts linear modules only")
    if lora.layers:
        problems.append(
            f"{key} with method.lora.layers: keel does not limit the experts' LoRA to some layers; "
            "remove one of them"
        )
    if cfg.method.type == "qlora" and cfg.method.qlora.quantize_experts:
        problems.append(
            f"{key} with method.qlora.quantize_experts: the experts would be NF4 and adapted at "
            f"once, which keel does not run; drop one of them"
        )
    return problems


def _check_qat(cfg: RunConfig) -> list[str]:
    qat = cfg.method.qat
    if qat.scheme == "none":
        return []
    problems = positive(qat.group_size, "method.qat.group_size")
    problems += positive(qat.start_step, "method.qat.start_step", allow_zero=True)
    if cfg.method.uses_adapter:
        problems.append(
            f"method.qat.scheme = {qat.scheme} with method.type = {cfg.method.type}: QAT "
            f"trains the weights the scheme rounds, and a merged adapter would change them "
            f"after training; use method.type full or freeze, or method.qat.scheme none"
        )
    return problems


DORA_ON_NF4 = (
    "method.lora.dora = true with method.qlora.quant_backend = torchao: PEFT's DoRA "
    "cannot read torchao's NF4 weights (it fails in the first forward); set "
    "method.qlora.quant_backend=bnb (one process or DDP), or method.type=lora"
)


# Measured with bitsandbytes 0.50 (issue 13): wrong results, not an error, so keel refuses.
BNB_UNDER_FSDP = (
    "method.qlora.quant_backend = bnb cannot run under distributed.strategy = fsdp: "
    "bitsandbytes' 4-bit weights shard correctly only when their storage dtype equals "
    "FSDP2's parameter dtype (with fp32 storage and a bf16 policy training is silently "
    "wrong, accelerate#3983), and its optimizers fail on sharded tensors; use "
    "quant_backend torchao (NF4 built for FSDP2), or distributed.strategy ddp"
)
