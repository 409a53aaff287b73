"""GRPO / Dr. GRPO / DAPO losses against hand-computed values and TRL 1.16's own trainer."""

import math
import types
from collections import defaultdict

import pytest
import torch

from keel.losses.grpo import (
    LOSS_TYPES,
    aggregate,
    group_advantages,
    loss_unit,
    policy_token_losses,
)


def t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


def close(tensor: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert tensor.tolist() == pytest.approx(expected, rel=tol, abs=tol)


# --- advantages ---------------------------------------------------------------------------


def test_group_advantages_by_hand():
    # G=2, rewards 1 and 0: mean 0.5, Bessel std sqrt(0.5); eps is added to the std
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    close(group_advantages(t(1, 0, 0, 1), 2), [a, -a, -a, a])
    # G=4 [1, 0, 0, 1]: std sqrt(1/3)
    b = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    close(group_advantages(t(1, 0, 0, 1), 4), [b, -b, -b, b])


def test_scale_none_and_batch():
    close(group_advantages(t(1, 0, 1, 1), 2, scale="none"), [0.5, -0.5, 0, 0])
    # batch std of [1, 0, 1, 1]: mean 0.75, variance (3 * 0.0625 + 0.5625) / 3 = 0.25
    close(group_advantages(t(1, 0, 1, 1), 2, scale="batch"), [0.5 / 0.5001, -0.5 / 0.5001, 0, 0])


def test_equal_rewards_give_zero_advantage():
    assert group_advantages(t(0.3, 0.3, 0.3, 2, 2, 2), 3).tolist() == [0.0] * 6


def test_nan_rewards_are_left_out_and_get_zero():
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    # group 1: one scorable sample (no std) -> 0; group 2 [1, NaN, 0]: baseline of 1 and 0
    nan = float("nan")
    close(group_advantages(t(1, nan, nan, 1, nan, 0), 3), [0, 0, 0, a, 0, -a])
    assert not group_advantages(t(nan, nan), 2).isnan().any()


def test_group_advantages_refuses_ragged_groups():
    with pytest.raises(ValueError, match="whole groups of 4"):
        group_advantages(t(1, 2, 3), 4)
    with pytest.raises(ValueError, match="scale="):
        group_advantages(t(1, 2), 2, scale="global")


# --- per-token surrogate ------------------------------------------------------------------


def test_clipped_surrogate_by_hand():
    # ratios 1.5, 0.5, 1.25, 0.5 with advantages +1, -1, +1, +1; eps_low 0.2, eps_high 0.28
    ratios = [1.5, 0.5, 1.25, 0.5]
    logps = t(*(math.log(r) for r in ratios), grad=True)
    out = policy_token_losses(
        logps, torch.zeros(4), t(1, -1, 1, 1), epsilon_low=0.2, epsilon_high=0.28
    )
    # -min(1.5, 1.28); -min(-0.5, -0.8); -min(1.25, 1.25); -min(0.5, 0.8)
    close(out.losses, [-1.28, 0.8, -1.25, -0.5])
    assert out.high_clipped.tolist() == [True, False, False, False]
    assert out.low_clipped.tolist() == [False, True, False, False]
    assert out.kl is None
    out.losses.sum().backward()
    # a clipped token has no gradient; an unclipped one d(-ratio*A)/dlogp = -ratio*A
    close(logps.grad, [0.0, 0.0, -1.25, -0.5])


def test_symmetric_clip_of_grpo():
    out = policy_token_losses(t(math.log(1.5)), t(0.0), t(1.0), epsilon_low=0.2, epsilon_high=0.2)
    close(out.losses, [-1.2])


def test_kl_term_is_k3_and_zero_at_the_reference():
    logps = t(-1.0, -2.0, -3.0, grad=True)
    ref = t(-1.0, -1.0, -4.0)  # d = ref - logp = 0, 1, -1
    out = policy_token_losses(
        logps,
        logps.detach(),
        t(0, 0, 0),
        epsilon_low=0.2,
        epsilon_high=0.2,
        ref_logps=ref,
        beta=0.1,
    )
    k3 = [0.0, math.e - 2, math.exp(-1)]
    close(out.kl, k3)
    assert (out.kl >= 0).all() and not out.kl.requires_grad
    close(out.losses, [0.1 * k for k in k3])  # A = 0: the KL term alone
    out.losses.sum().backward()
    # d/dl beta*(e^(r-l) - (r-l) - 1) = beta*(1 - e^(r-l))
    close(logps.grad, [0.0, 0.1 * (1 - math.e), 0.1 * (1 - math.exp(-1))])


def test_ratio_one_gives_minus_advantage():
    # one policy update per rollout: old = logps.detach(), so the value is -A
    logps = t(-1.0, -0.5)
    out = policy_token_losses(logps, logps, t(0.7, -0.3), epsilon_low=0.2, epsilon_high=0.28)
    close(out.losses, [-0.7, 0.3])
    assert not out.low_clipped.any() and not out.high_clipped.any()


def test_beta_without_reference_is_refused():
    with pytest.raises(ValueError, match="needs ref_logps"):
        policy_token_losses(t(0.0), t(0.0), t(1.0), epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


# --- aggregation --------------------------------------------------------------------------

# completions of 3, 1, 2 and 0 target tokens (the last one truncated and masked)
LOSSES = t(1, 2, 3, 4, 5, 6)
SEQUENCE = torch.tensor([0, 0, 0, 1, 2, 2])


def test_aggregations_by_hand_differ_on_ragged_completions():
    assert aggregate("grpo", LOSSES, SEQUENCE, 4, 4).item() == pytest.approx(2 + 4 + 5.5 + 0)
    assert aggregate("dr_grpo", LOSSES, SEQUENCE, 4, 4).item() == pytest.approx(21 / 4)
    assert aggregate("dapo", LOSSES, SEQUENCE, 4, 4).item() == pytest.approx(21)
    assert [loss_unit(k) for k in LOSS_TYPES] == ["completions", "completions", "completion_tokens"]
    with pytest.raises(ValueError, match="loss_type"):
        aggregate("bnpo", LOSSES, SEQUENCE, 4, 4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_micro_batches_give_the_loss_of_one(loss_type):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1, 0, 4, 2]
    sequence = torch.repeat_interleave(torch.arange(6), torch.tensor(lengths))
    losses = torch.randn(sum(lengths), generator=gen)
    units = {"completions": 6, "completion_tokens": sum(lengths)}[loss_unit(loss_type)]
    whole = aggregate(loss_type, losses, sequence, 6, 8) / units
    cut = sum(lengths[:3])  # micro-batch 1: completions 0-2; 2: completions 3-5, renumbered
    first = aggregate(loss_type, losses[:cut], sequence[:cut], 3, 8)
    second = aggregate(loss_type, losses[cut:], sequence[cut:] - 3, 3, 8)
    assert ((first + second) / units).item() == pytest.approx(whole.item(), rel=1e-6)


# --- parity with TRL 1.16's GRPOTrainer._compute_loss (the stub technique) ----------------

B, T, G, LMAX = 8, 6, 4, 6


def _fixed_batch():
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[5, 2:] = 0
    mask[6, 5:] = 0
    logps = torch.randn(B, T, generator=gen) * 0.5 - 2.0
    old = logps + torch.randn(B, T, generator=gen) * 0.3  # ratios != 1: clipping is active
    ref = logps + torch.randn(B, T, generator=gen) * 0.2
    rewards = t(1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5)
    return mask, logps, old, ref, rewards


class _Accelerator:
    num_processes = 1

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def gather_for_metrics(self, x):
        return x


def _trl_loss(loss_type, beta, epsilon_high, logps, inputs):
    from trl import GRPOTrainer

    stub = types.SimpleNamespace(
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=LMAX,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(
            use_bias_correction_kl=False, delta=None, steps_per_generation=1
        ),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros(B, T), None),
    )
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, stub._metrics["train"]


def test_advantages_equal_trls():
    from trl.trainer.utils import nanstd

    *_, rewards = _fixed_batch()
    mean = torch.nanmean(rewards.view(-1, G), 1).repeat_interleave(G)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    trl_group = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    assert torch.equal(group_advantages(rewards, G), trl_group)
    trl_batch = torch.nan_to_num((rewards - mean) / (nanstd(rewards) + 1e-4), nan=0.0)
    assert torch.equal(group_advantages(rewards, G, scale="batch"), trl_batch)


@pytest.mark.parametrize(
    "loss_type, beta, epsilon_high",
    [
        ("grpo", 0.0, 0.2),
        ("grpo", 0.04, 0.2),
        ("dr_grpo", 0.0, 0.2),
        ("dr_grpo", 0.04, 0.2),
        ("dapo", 0.0, 0.28),
        ("dapo", 0.04, 0.28),
    ],
)
def test_loss_gradient_and_metrics_equal_trls(loss_type, beta, epsilon_high):
    mask, logps_init, old, ref, rewards = _fixed_batch()
    advantages = group_advantages(rewards, G)
    trl_logps = logps_init.clone().requires_grad_(True)
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1),
        completion_ids=torch.zeros(B, T, dtype=torch.long),
        completion_mask=mask,
        advantages=advantages,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        num_items_in_batch=mask.sum(),
    )
    trl_loss, metrics = _trl_loss(loss_type, beta, epsilon_high, trl_logps, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, trl_logps)

    # keel: flat over target tokens, each token with its completion's index and advantage
    keel_logps = logps_init.clone().requires_grad_(True)
    where = mask.bool()
    sequence = torch.arange(B).unsqueeze(1).expand(B, T)[where]
    out = policy_token_losses(
        keel_logps[where],
        old[where],
        advantages[sequence],
        epsilon_low=0.2,
        epsilon_high=epsilon_high,
        ref_logps=ref[where],
        beta=beta,
    )
    units = {"completions": B, "completion_tokens": mask.sum()}[loss_unit(loss_type)]
    keel_loss = aggregate(loss_type, out.losses, sequence, B, LMAX) / units
    (keel_grad,) = torch.autograd.grad(keel_loss, keel_logps)

    torch.testing.assert_close(keel_loss, trl_loss, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(keel_grad, trl_grad, rtol=1e-6, atol=1e-8)
    tokens = mask.sum().item()
    assert out.low_clipped.sum().item() / tokens == pytest.approx(
        metrics["clip_ratio/low_mean"][-1]
    )
    assert out.high_clipped.sum().item() / tokens == pytest.approx(
        metrics["clip_ratio/high_mean"][-1]
    )
    assert out.low_clipped.sum() > 0 and out.high_clipped.sum() > 0  # the case is not vacuous
    if beta:
        assert out.kl.sum().item() / tokens == pytest.approx(metrics["kl"][-1], rel=1e-6)
