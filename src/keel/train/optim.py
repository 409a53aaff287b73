"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from keel.config.schema import TrainConfig
from keel.models.trainable import muon_weights
from keel.quant import import_torchao
from keel.quant.optim_state import LOW_BIT, MIN_NUMEL, adamw_state_bytes
from keel.train.muon import MuonAdamW


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, lora_plus_ratio: float | None = None
) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norm weights (1-D) get no weight decay.
    `lora_plus_ratio` (method.lora.plus_lr_ratio, LoRA+): the LoRA B matrices' groups learn
    at train.lr x this; each group's `lr_scale` is the multiple of train.lr it learns at,
    which the schedule keeps (`build_scheduler`).

    train.optimizer adamw: torch's AdamW, moments in the parameters' dtype. adamw_8bit /
    adamw_4bit: torchao's AdamW8bit / AdamW4bit (keel.quant.optim_state), the same update
    in fp32 with each moment stored block-quantised between steps: 8-bit codes in blocks
    of 256 or 4-bit codes in blocks of 128, one fp32 scale per block. Tensors with fewer
    than 4096 values (per process under FSDP2) or not a whole number of blocks keep
    full-precision moments (torchao's rule, after bitsandbytes; pytorch/ao#4912), so on
    small models or LoRA adapters little or nothing is quantised. The first step compiles
    the update with torch.compile (seconds; needs a C compiler, which keel.train.preflight
    checks). Checkpoints hold the quantised moments as torchao's tensor subclasses, which
    torchao adds to torch's `weights_only` allow-list on import, so keel's loader reads
    them as it reads plain tensors. muon: keel.train.muon.MuonAdamW, Muon on the weight
    matrices (keel.models.trainable.muon_weights, in groups marked `muon`), AdamW on the
    rest.
    """
    scales = (1.0, lora_plus_ratio or 1.0)
    muon = cfg.optimizer == "muon"
    on_muon = muon_weights(model) if muon else set()
    # (scale index, decays, muon) -> params; the train.lr groups first, so param_groups[0]
    # (the lr keel logs) is train.lr's
    grouped: dict[tuple[int, bool, bool], list] = {
        (i, d, m): [] for i in (0, 1) for d in (True, False) for m in (False, True)
    }
    for name, param in model.named_parameters():
        if param.requires_grad:
            plus = lora_plus_ratio is not None and _is_lora_b(name)
            grouped[(int(plus), param.ndim >= 2, id(param) in on_muon)].append(param)
    groups = [
        {
            "params": params,
            "weight_decay": cfg.weight_decay if decays else 0.0,
            "lr": cfg.lr * scales[index],
            "lr_scale": scales[index],
            **({"muon": by_muon} if muon else {}),
        }
        for (index, decays, by_muon), params in grouped.items()
        if params
    ]
    assert groups, "no trainable parameters"
    hyper = dict(lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, **hyper)
    if muon:
        return MuonAdamW(groups, **hyper)
    optim = import_torchao("optim", needed_for=f"train.optimizer = {cfg.optimizer}")
    return getattr(optim, LOW_BIT[cfg.optimizer].cls)(groups, **hyper)


def _is_lora_b(name: str) -> bool:
    """A LoRA B matrix (PEFT's names: lora_B for linear layers, lora_embedding_B)."""
    return any(part in ("lora_B", "lora_embedding_B") for part in name.split("."))


def describe_optimizer(optimizer: torch.optim.Optimizer, choice: str) -> str:
    """One line for the set-up log: which optimizer, what stays full precision, its bytes."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = [(_local_numel(p), p.element_size()) for p in params]
    full = sum(adamw_state_bytes("adamw", n, size) for n, size in local) / 2**20
    scaled = [g for g in optimizer.param_groups if g.get("lr_scale", 1.0) != 1.0]
    plus = ""
    if scaled:
        count, scale = sum(len(g["params"]) for g in scaled), scaled[0]["lr_scale"]
        plus = f"; LoRA+: the {count} LoRA B matrices learn at {scale:g} x train.lr"
    if choice == "muon":
        matrices = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
        buffers = sum(_local_numel(p) * p.element_size() for p in matrices) / 2**20
        rest = len(params) - len(matrices)
        return (
            f"optimizer: Muon on {len(matrices)} weight matrices (a momentum buffer each, "
            f"{buffers:.1f} MiB), AdamW on the other {rest} tensors{plus}"
        )
    if choice not in LOW_BIT:
        return f"optimizer: AdamW (torch), moments in the parameters' dtype ({full:.1f} MiB){plus}"
    low = LOW_BIT[choice]
    kept = sum(not low.quantised(n) for n, _ in local)
    held = sum(adamw_state_bytes(choice, n, size) for n, size in local) / 2**20
    return (
        f"optimizer: AdamW {low.bits}-bit (torchao), moments in {low.bits}-bit blocks of "
        f"{low.block_size}; {kept} of {len(local)} tensors keep full-precision moments "
        f"(< {MIN_NUMEL} values or not whole blocks); state {held:.1f} MiB per process "
        f"(AdamW: {full:.1f} MiB){plus}"
    )


def _local_numel(param: torch.Tensor) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def warmup_steps_for(cfg: TrainConfig, total_steps: int) -> int:
    if cfg.warmup_steps:
        return min(cfg.warmup_steps, total_steps)
    return int(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, *, total_steps: int, warmup: int, kind: str, floor: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based).

    Linear warmup over `warmup` steps, then cosine or linear from 1 down to `floor`
    (train.min_lr_ratio) at the last step, or constant.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    progress = min(1.0, progress)
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps_for(cfg, total_steps)
    for group in optimizer.param_groups:
        # The schedule multiplies this; torchao's optimizers hold group["lr"] as a tensor,
        # which LambdaLR would copy (keep a float: the same value before and after resume).
        group["initial_lr"] = cfg.lr * group.get("lr_scale", 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            total_steps=total_steps,
            warmup=warmup,
            kind=cfg.scheduler,
            floor=cfg.min_lr_ratio,
        ),
    )


def continue_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: TrainConfig,
    total_steps: int,
    saved_total: int | None,
) -> str | None:
    """After a checkpoint's state is loaded, put each group's lr on this run's schedule.

    The rule: a resumed run follows the schedule for its own length (train.scheduler over
    `total_steps`) from the saved step on, exactly as an uninterrupted run of that length
    would. The optimizer state holds the lr the checkpoint's schedule chose for the next
    step; when the run's length changed (train.max_steps raised to extend it) that is the
    old schedule's value (0.0 at a cosine's end), so it is replaced, and the line returned
    says so with both values. None: nothing changed (the same length resumes as it was).
    """
    step = scheduler.last_epoch  # optimizer steps done = the 0-based index of the next one
    moved = None
    for group, base, factor in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        restored, scheduled = float(group["lr"]), base * factor(step)
        if math.isclose(restored, scheduled, rel_tol=1e-9, abs_tol=1e-15):
            continue
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers hold a tensor
            group["lr"].fill_(scheduled)
        else:
            group["lr"] = scheduled
        moved = moved or (restored, scheduled)
    if moved is None:
        return None
    before = f"its {saved_total}-step schedule" if saved_total else "its schedule"
    return (
        f"lr schedule: {cfg.scheduler} over this run's {total_steps} steps; step {step + 1} "
        f"runs at lr {moved[1]:.3g} where the checkpoint's, from {before}, was {moved[0]:.3g} "
        f"(a resumed run continues on the schedule of its own length)"
    )
