"""LoRA starts that split each base weight (method.lora.init: pissa, olora): the adapter
starts as a part of the weight, the frozen base keeps the rest, so the model starts as it
was and training moves that part first.

- PiSSA: W [out, in]'s top-r singular triplets U_r S_r V_r^T with the LoRA scale s give
  A = sqrt(S_r / s) V_r^T and B = U_r sqrt(S_r / s) (PEFT's `init_lora_weights="pissa"`,
  "pissa_niter_N" for the randomised SVD).
- OLoRA: W's QR decomposition gives A = R_r (its first r rows) and B = Q_r (its first r
  columns) (PEFT's "olora").

Either way the base keeps W_res = W - s B A. keel computes this while it loads the weights
(keel.models.materialize): each process reads the whole checkpoint tensor there, so every
process, sharded or not, decomposes the same matrix and keeps its own rows of W_res, A and
B. The factors' signs are fixed (PiSSA: each U column's largest entry positive; OLoRA: R's
diagonal positive) so that every process agrees.

The start (A0, B0) stays on the module (`SPLIT_START`, on the CPU): W_res + s B A = W +
s (B A - B0 A0), so an adapter saved as [A; A0] and [B, -B0] of rank 2r (with lora_alpha
doubled, or times sqrt 2 under rsLoRA, to keep the scale) is a plain LoRA that applies to
the original base: the folder keel writes is that one (PEFT's conversion), loadable by any
tool on the model the user has. A resumed run decomposes again; W_res depends only on the
product B0 A0, so its round-off is the same on every machine.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SPLIT_START = "keel_split_start"  # a LoRA module's (A0, B0): its adapter's first values
SPLITS = ("pissa", "olora")  # the method.lora.init values that split the base weights
_ADAPTER = "default"


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every LoRA linear module: those a split start decomposes."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and _ADAPTER in module.lora_A
    ]


def fill_split(
    model: nn.Module,
    read_full: Callable[[str], torch.Tensor],
    starts: SplitStart,
    *,
    region_of: Callable[[torch.Tensor], tuple[slice, ...] | None],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Start every LoRA linear module as `starts.kind` splits it: its base weight W_res and
    its A and B, each process its own region of them. `read_full(param_name)` is the whole
    checkpoint tensor of a base weight."""
    names = {id(param): name for name, param in model.named_parameters()}
    for module_name, module in lora_modules(model):
        base = module.get_base_layer()
        lora_a, lora_b = module.lora_A[_ADAPTER].weight, module.lora_B[_ADAPTER].weight
        device = local(lora_a).device
        weight = read_full(names[id(base.weight)]).to(device=device, dtype=torch.float32)
        transposed = getattr(module, "fan_in_fan_out", False)  # GPT-2's Conv1D: [in, out]
        if transposed:
            weight = weight.t()
        rank, scale = module.r[_ADAPTER], module.scaling[_ADAPTER]
        if starts.kind == "olora":
            a, b = olora_factors(weight, rank)
        else:
            a, b = pissa_factors(weight, rank, scale, starts.iters, _seed(starts.seed, module_name))
        residual = weight - scale * (b @ a)
        if transposed:
            residual = residual.t()
        for param, full in ((base.weight, residual), (lora_a, a), (lora_b, b)):
            region = region_of(param)
            local(param).copy_(full if region is None else full[region])
        start = (a.to(lora_a.dtype).cpu(), b.to(lora_b.dtype).cpu())
        object.__setattr__(module, SPLIT_START, start)  # a plain attribute: no state dict


@dataclass(frozen=True)
class SplitStart:
    """How the LoRA modules start: `kind` pissa or olora; pissa's `iters` (0: the exact
    SVD, else torch.svd_lowrank's iterations, seeded by `seed` and the module's name, the
    same on every process)."""

    kind: str
    iters: int = 16
    seed: int = 0


def olora_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OLoRA's (A [rank, in], B [out, rank]) of an fp32 weight [out, in]: B A is the part of
    the weight on the first `rank` columns of its QR decomposition's Q."""
    q, r = torch.linalg.qr(weight)
    q, r = q[:, :rank], r[:rank]
    flip = torch.sign(torch.diagonal(r))  # R's diagonal positive: the QR every LAPACK gives
    flip[flip == 0] = 1.0
    return r * flip.unsqueeze(1), q * flip.unsqueeze(0)


def pissa_factors(
    weight: torch.Tensor, rank: int, scale: float, iters: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PiSSA's (A [rank, in], B [out, rank]) of an fp32 weight [out, in]: s B A is its best
    rank-`rank` approximation (randomised with `iters` > 0)."""
    if iters == 0:
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    else:
        devices = [weight.device] if weight.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            u, s, v = torch.svd_lowrank(weight, q=rank, niter=iters)
        vh = v.t()
    # each pair's sign fixed: its U column's largest entry positive
    flip = torch.sign(u.gather(0, u.abs().argmax(dim=0, keepdim=True)))
    flip[flip == 0] = 1.0
    u, vh = u * flip, vh * flip.t()
    root = torch.sqrt(s / scale)
    return root.unsqueeze(1) * vh, u * root.unsqueeze(0)


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:pissa:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def splits_base(model: nn.Module) -> bool:
    return any(hasattr(module, SPLIT_START) for _, module in lora_modules(model))


def save_split_as_lora(model: nn.Module, out_dir: Path) -> None:
    """Rewrite the PEFT adapter just saved in `out_dir` from `model` (a run whose start split
    the base weights) as a plain LoRA of twice the rank on the original base: A' = [A; A0],
    B' = [B, -B0]."""
    from safetensors.torch import load_file, save_file

    weights_file = out_dir / "adapter_model.safetensors"
    saved = load_file(str(weights_file))
    starts = {name: getattr(module, SPLIT_START) for name, module in lora_modules(model)}
    converted, done = dict(saved), set()
    for key, value in saved.items():
        module, _, kind = key.rpartition(".lora_")
        if module not in starts or kind not in ("A.weight", "B.weight"):
            continue
        done.add((module, kind))
        a0, b0 = starts[module]
        if kind == "A.weight":
            converted[key] = torch.cat([value, a0.to(value.dtype)], dim=0).contiguous()
        else:
            converted[key] = torch.cat([value, -b0.to(value.dtype)], dim=1).contiguous()
    # every started module's A and B converted: an unconverted one would be wrong silently
    assert len(done) == 2 * len(starts), f"{len(done)} of {2 * len(starts)} split tensors"
    save_file(converted, str(weights_file), metadata={"format": "pt"})
    config_file = out_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["r"] *= 2
    config["lora_alpha"] *= math.sqrt(2) if config.get("use_rslora") else 2
    for pattern, factor in (("rank_pattern", 2), ("alpha_pattern", 2)):
        if config.get(pattern):
            config[pattern] = {key: factor * value for key, value in config[pattern].items()}
    config["init_lora_weights"] = True
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
