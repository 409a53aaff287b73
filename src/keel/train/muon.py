"""train.optimizer muon: Muon on the weight matrices, AdamW on everything else.

Muon (Jordan et al. 2024; torch.optim.Muon) keeps a momentum buffer per matrix and steps
along its orthogonalised direction: the buffer's quintic Newton-Schulz iteration (five
steps in bf16) maps it to about U V^T of its SVD. The step is scaled by 0.2 sqrt(max(rows,
columns)), so that its RMS matches AdamW's and train.lr means what it means for AdamW (the
Moonlight scaling, torch's adjust_lr_fn="match_rms_adamw", LLaMA-Factory's use_muon).
Weight decay is decoupled: weights shrink by lr x weight_decay each step.

Which weights: every trained matrix (2-D) but the input embeddings and the output layer
(a row per token: not a linear map to orthogonalise), LoRA's A and B included; a mixture of
experts' fused [experts, rows, columns] weights as one matrix per expert. The rest (norms,
biases, embeddings, output layer, DoRA magnitudes, conv weights) is AdamW with train's
betas, eps and weight decay.

Under FSDP2 each process holds rows of a matrix; the iteration needs the whole one, so each
matrix's update is gathered (all processes, in the same order), orthogonalised the same on
every process, and each keeps its own rows: one process's step, at the cost of an
all-gather per matrix per step and one whole matrix's transient memory.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch's and Keller Jordan's quintic
NS_STEPS = 5
NS_EPS = 1e-7
MOMENTUM = 0.95  # nesterov


def orthogonalise(update: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz's approximation of U V^T for [rows, columns] or a batch of them
    ([n, rows, columns]), in bf16; as torch.optim.Muon computes it for a matrix."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(NS_STEPS):
        if x.ndim == 2:
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def step_scale(shape: torch.Size) -> float:
    """0.2 sqrt(max(rows, columns)): Muon's step at AdamW's RMS (per expert for [n, r, c])."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class MuonAdamW(torch.optim.AdamW):
    """AdamW whose groups marked `muon` step by Muon instead (see the module docstring).
    One optimizer, so checkpoints (DCP), the schedule (each group's lr) and LoRA+'s groups
    work as for AdamW; a Muon weight's state is its momentum buffer and step count."""

    def __init__(self, groups: list[dict], **adamw):
        for group in groups:
            group.setdefault("muon", False)
        super().__init__(groups, **adamw)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "keel steps without a closure"
        every = self.param_groups
        self.param_groups = [g for g in every if not g["muon"]]
        try:
            if self.param_groups:
                super().step()
        finally:
            self.param_groups = every
        for group in every:
            if group["muon"]:
                self._muon_step(group)

    def _muon_step(self, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
                # the step count as AdamW keeps it (its load_state_dict reads every state's)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["step"] += 1
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - MOMENTUM)
            update = param.grad.lerp(buffer, MOMENTUM)  # nesterov
            direction = _whole_orthogonalised(update)
            param.mul_(1 - lr * decay)
            param.add_(direction.to(param.dtype), alpha=-lr * step_scale(param.shape))


def _whole_orthogonalised(update: torch.Tensor) -> torch.Tensor:
    """orthogonalise(update), for an FSDP2 shard from the whole matrix, as this process's
    shard again."""
    if not isinstance(update, DTensor):
        return orthogonalise(update)
    whole = orthogonalise(update.full_tensor())
    mesh = update.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, update.placements)
