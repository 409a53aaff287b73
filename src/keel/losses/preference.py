"""Preference losses (DPO, ORPO, SimPO, KTO) as pure functions of per-sequence log-probs.

Every function takes 1-D tensors of per-sequence log-probabilities (one entry per pair or
per sample), computes in float32, and returns *per-sequence* losses: the trainer sums them
and divides by the number of pairs (or samples) in the global batch, so a pair weighs the
same whatever micro-batch or rank it landed in. Reward statistics are detached: they are
for logging only.

What "log-prob of a completion" means differs by method, and the caller must match it:
- DPO (sigmoid, robust, hinge) and KTO: the SUM of the completion's token log-probs.
- DPO with loss_type="ipo", ORPO and SimPO: the MEAN per-token log-prob of the completion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge")
_SMOOTHING_FREE_DPO_TYPES = ("ipo", "hinge")
_LOG_HALF = -math.log(2.0)
_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32; keeps log() finite


@dataclass(frozen=True)
class PairLosses:
    """Per-pair output of DPO, ORPO and SimPO; every tensor is [P]."""

    losses: Tensor  # [P] per-pair loss; the trainer sums and divides by the global pair count
    chosen_rewards: Tensor  # [P] detached
    rejected_rewards: Tensor  # [P] detached
    extras: dict[str, Tensor] = field(default_factory=dict)  # name -> [P], detached


@dataclass(frozen=True)
class SampleLosses:
    """Per-sample output of KTO; every tensor is [N]."""

    losses: Tensor  # [N] per-sample weighted loss
    rewards: Tensor  # [N] beta * (policy - reference), detached


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PairLosses:
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290) and variants.

    Inputs [P] are SUMMED token log-probs of each completion under the policy and the frozen
    reference, except for loss_type="ipo", where the caller passes length-normalised (mean
    per-token) log-probs, as TRL's DPOTrainer does for IPO.

        logits = (pc - pr) - (rc - rr)
        sigmoid: -logsigmoid(beta*logits)*(1-ls) - logsigmoid(-beta*logits)*ls
        robust:  (-logsigmoid(beta*logits)*(1-ls) + logsigmoid(-beta*logits)*ls) / (1-2*ls)
                 (Chowdhury et al. 2024, arXiv:2403.00409: unbiased under label noise ls)
        ipo:     (logits - 1/(2*beta))**2          (Azar et al. 2023, arXiv:2310.12036)
        hinge:   relu(1 - beta*logits)             (SLiC, Zhao et al. 2023, arXiv:2305.10425)

    Rewards: chosen = beta*(pc - rc), rejected = beta*(pr - rr), in the units of the inputs
    (per token for "ipo"). ls = label_smoothing, the assumed probability that a preference
    label is flipped (conservative DPO for "sigmoid"). Gradients flow to the policy inputs
    only; the reference inputs are detached.
    """
    _check_dpo_settings(beta, loss_type, label_smoothing)
    pc, pr, rc, rr = _as_float32(
        "dpo_loss", policy_chosen, policy_rejected, reference_chosen, reference_rejected
    )
    rc, rr = rc.detach(), rr.detach()  # the reference model is frozen: a constant here
    logits = (pc - pr) - (rc - rr)  # [P]
    return PairLosses(
        losses=_dpo_losses(logits, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing),
        chosen_rewards=(beta * (pc - rc)).detach(),
        rejected_rewards=(beta * (pr - rr)).detach(),
        extras={},
    )


def _check_dpo_settings(beta: float, loss_type: str, label_smoothing: float) -> None:
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"dpo_loss: loss_type={loss_type!r} is not supported; choose one of "
            f"{', '.join(DPO_LOSS_TYPES)}."
        )
    _check_beta("dpo_loss", beta)
    _check_label_smoothing("dpo_loss", label_smoothing)
    if loss_type in _SMOOTHING_FREE_DPO_TYPES and label_smoothing != 0.0:
        raise ValueError(
            f"dpo_loss: loss_type={loss_type!r} does not use label smoothing, but "
            f"label_smoothing={label_smoothing}; set it to 0 or use loss_type 'sigmoid' "
            "or 'robust'."
        )


def _dpo_losses(logits: Tensor, *, beta: float, loss_type: str, label_smoothing: float) -> Tensor:
    """Per-pair DPO loss [P] of the implicit-reward margins `logits` [P] (formulas: dpo_loss)."""
    if loss_type == "sigmoid":
        return _smoothed_logistic(beta * logits, label_smoothing)
    if loss_type == "robust":
        agree = -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        flipped = F.logsigmoid(-beta * logits) * label_smoothing
        return (agree + flipped) / (1 - 2 * label_smoothing)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    return torch.relu(1 - beta * logits)


def orpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, *, beta: float) -> PairLosses:
    """Odds Ratio Preference Optimization (Hong et al. 2024, arXiv:2403.07691); no reference.

    Inputs [P] are MEAN per-token log-probs of each completion (so both are <= 0).

        log_odds = (pc - pr) - (log(1 - exp(pc)) - log(1 - exp(pr)))
        ratio    = logsigmoid(log_odds)
        nll      = -pc                  (the chosen completion's mean token NLL: the SFT term)
        loss     = nll - beta * ratio   (beta is the paper's lambda)

    log(1 - exp(x)) is computed stably: via log(-expm1(x)) near 0, where 1 - exp(x) cancels,
    and via log1p(-exp(x)) below -ln 2; -expm1(x) is clamped at the smallest normal float32,
    so x = 0 (a completion of probability 1) gives a large finite value instead of -inf.

    Rewards: beta*pc and beta*pr. Extras: nll_loss, log_odds_ratio (ratio), log_odds_chosen
    (log_odds).
    """
    _check_beta("orpo_loss", beta)
    pc, pr = _as_float32("orpo_loss", policy_chosen, policy_rejected)
    log_odds = (pc - pr) - (_log1m_exp(pc) - _log1m_exp(pr))  # [P]
    ratio = F.logsigmoid(log_odds)  # [P]
    nll = -pc  # [P]
    return PairLosses(
        losses=nll - beta * ratio,
        chosen_rewards=(beta * pc).detach(),
        rejected_rewards=(beta * pr).detach(),
        extras={
            "nll_loss": nll.detach(),
            "log_odds_ratio": ratio.detach(),
            "log_odds_chosen": log_odds.detach(),
        },
    )


def simpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> PairLosses:
    """Simple Preference Optimization (Meng et al. 2024, arXiv:2405.14734); no reference.

    Inputs [P] are MEAN per-token log-probs of each completion (length-normalised rewards).

        logits = beta*(pc - pr) - gamma         (gamma: target reward margin)
        loss   = -logsigmoid(logits)*(1-ls) - logsigmoid(-logits)*ls

    Rewards: beta*pc and beta*pr.
    """
    _check_beta("simpo_loss", beta)
    _check_label_smoothing("simpo_loss", label_smoothing)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(
            f"simpo_loss: gamma={gamma} must be a finite number >= 0 (the target reward "
            "margin; the SimPO paper uses 0.5-1.6 with beta 2-2.5)."
        )
    pc, pr = _as_float32("simpo_loss", policy_chosen, policy_rejected)
    logits = beta * (pc - pr) - gamma  # [P]
    return PairLosses(
        losses=_smoothed_logistic(logits, label_smoothing),
        chosen_rewards=(beta * pc).detach(),
        rejected_rewards=(beta * pr).detach(),
        extras={},
    )


def kto_kl(policy_mismatched: Tensor, reference_mismatched: Tensor) -> Tensor:
    """Per-pair log-ratio policy - reference on MISMATCHED prompt/completion pairs, [M], detached.

    Inputs [M] are SUMMED token log-probs of a completion paired with another sample's prompt.
    KTO's reference point is z0 = max(0, mean over the GLOBAL batch of kto_kl(...)): the
    caller sums these over every rank and micro-batch, divides by the global count, clamps
    at 0 and passes the result to `kto_loss(kl=...)`. No gradient flows through z0.
    """
    policy, reference = _as_float32("kto_kl", policy_mismatched, reference_mismatched)
    return (policy - reference).detach()


def kto_loss(
    policy: Tensor,
    reference: Tensor,
    desirable: Tensor,
    *,
    kl: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> SampleLosses:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306).

    Inputs [N] are SUMMED token log-probs of each completion under the policy and the frozen
    reference (detached here); desirable [N] is bool (True: a good completion). kl is the
    reference point z0 >= 0 (scalar, see `kto_kl`), already clamped; treated as a constant.
    With r = policy - reference:

        desirable:   desirable_weight   * (1 - sigmoid(beta * (r - z0)))
        undesirable: undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

    Rewards: beta * r (detached).
    """
    _check_beta("kto_loss", beta)
    for name, weight in (
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"kto_loss: {name}={weight} must be a finite number > 0 (the paper "
                "suggests weights so that desirable_weight*n_desirable / "
                "(undesirable_weight*n_undesirable) lies in [1, 4/3])."
            )
    pol, ref = _as_float32("kto_loss", policy, reference)
    ref = ref.detach()  # the reference model is frozen: a constant here
    if desirable.dtype != torch.bool or desirable.shape != pol.shape:
        raise ValueError(
            f"kto_loss: desirable must be a bool tensor of shape {tuple(pol.shape)}, got "
            f"dtype {desirable.dtype} and shape {tuple(desirable.shape)}."
        )
    z0 = _reference_point(kl, pol)
    log_ratio = pol - ref  # [N]
    good = desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - z0)))  # [N]
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - log_ratio)))  # [N]
    return SampleLosses(
        losses=torch.where(desirable.to(pol.device), good, bad),
        rewards=(beta * log_ratio).detach(),
    )


def _smoothed_logistic(logits: Tensor, label_smoothing: float) -> Tensor:
    """-logsigmoid(x)*(1-ls) - logsigmoid(-x)*ls: logistic loss with labels flipped at rate ls."""
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def _log1m_exp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0 without cancellation (Maechler 2012, "log1mexp").

    Each branch gets an input clamped into its own safe range, so the branch torch.where
    discards cannot send inf or nan into the gradient.
    """
    near_zero = torch.log(torch.clamp(-torch.expm1(x), min=_TINY))
    far = torch.log1p(-torch.exp(torch.clamp(x, max=_LOG_HALF)))
    return torch.where(x > _LOG_HALF, near_zero, far)


def _reference_point(kl: Tensor | float, like: Tensor) -> Tensor:
    if isinstance(kl, Tensor):
        if kl.numel() != 1:
            raise ValueError(
                f"kto_loss: kl must be a scalar (the batch-mean reference point z0), got "
                f"shape {tuple(kl.shape)}; average kto_kl(...) over the global batch first."
            )
        return kl.detach().reshape(()).to(device=like.device, dtype=torch.float32)
    if not math.isfinite(kl) or kl < 0:
        raise ValueError(
            f"kto_loss: kl={kl} must be a finite number >= 0; clamp the batch mean of "
            "kto_kl(...) at 0 before passing it."
        )
    return like.new_tensor(kl)


def _as_float32(where: str, *tensors: Tensor) -> list[Tensor]:
    shape = tensors[0].shape
    if len(shape) != 1 or any(t.shape != shape for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(
            f"{where}: log-prob inputs must be 1-D of equal length, got shapes {shapes}."
        )
    return [t.float() for t in tensors]


def _check_beta(where: str, beta: float) -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"{where}: beta={beta} must be a finite number > 0 (e.g. 0.1).")


def _check_label_smoothing(where: str, label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"{where}: label_smoothing={label_smoothing} must be in [0, 0.5) (the assumed "
            "rate of flipped preference labels; 0 disables it)."
        )
