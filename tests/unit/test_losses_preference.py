"""Preference losses against values worked out by hand with `math` on concrete pairs."""

import math

import pytest
import torch

from keel.losses import (
    DPO_LOSS_TYPES,
    dpo_loss,
    kto_kl,
    kto_loss,
    orpo_loss,
    simpo_loss,
)


def softplus(x: float) -> float:
    """log(1 + e^x) = -log(sigmoid(-x))."""
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


def close(tensor: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert tensor.tolist() == pytest.approx(expected, rel=tol, abs=tol)


# Three pairs of summed log-probs. logits = (pc - pr) - (rc - rr) = 2, 0, -4.
PC, PR, RC, RR = (
    (-10.0, -5.0, -20.0),
    (-14.0, -5.0, -12.0),
    (-11.0, -5.0, -18.0),
    (-13.0, -5.0, -14.0),
)
LOGITS = (2.0, 0.0, -4.0)
BETA = 0.1


def dpo(loss_type: str = "sigmoid", label_smoothing: float = 0.0, beta: float = BETA):
    return dpo_loss(
        t(*PC),
        t(*PR),
        t(*RC),
        t(*RR),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
    )


def test_dpo_sigmoid_matches_hand_values_and_rewards():
    out = dpo()
    # -log sigmoid(beta * logits) = softplus(-beta * logits); logits 0 gives ln 2
    close(out.losses, [softplus(-0.2), math.log(2.0), softplus(0.4)])
    assert out.losses[1].item() == pytest.approx(math.log(2.0), rel=1e-6)
    close(out.chosen_rewards, [0.1 * (-10 + 11), 0.0, 0.1 * (-20 + 18)])
    close(out.rejected_rewards, [0.1 * (-14 + 13), 0.0, 0.1 * (-12 + 14)])
    assert out.extras == {}


def test_dpo_policy_equal_to_reference_gives_ln2_and_zero_rewards():
    logps = t(-3.0, -40.0, -7.5)
    out = dpo_loss(logps, logps.flip(0), logps, logps.flip(0), beta=0.5)
    close(out.losses, [math.log(2.0)] * 3)
    close(out.chosen_rewards, [0.0] * 3)
    close(out.rejected_rewards - out.chosen_rewards, [0.0] * 3)


def test_dpo_label_smoothing_sigmoid_and_robust():
    ls = 0.1
    expected_sigmoid = [(1 - ls) * softplus(-BETA * x) + ls * softplus(BETA * x) for x in LOGITS]
    close(dpo("sigmoid", ls).losses, expected_sigmoid)
    expected_robust = [
        ((1 - ls) * softplus(-BETA * x) - ls * softplus(BETA * x)) / (1 - 2 * ls) for x in LOGITS
    ]
    close(dpo("robust", ls).losses, expected_robust)
    # without label noise the robust loss is plain DPO
    close(dpo("robust", 0.0).losses, [softplus(-BETA * x) for x in LOGITS])


def test_dpo_ipo_and_hinge_hand_values():
    # ipo: (logits - 1/(2 beta))^2 with 1/(2 * 0.1) = 5
    close(dpo("ipo").losses, [(2 - 5) ** 2, 25.0, (-4 - 5) ** 2])
    # hinge: relu(1 - beta * logits); a margin beyond 1/beta costs nothing
    close(dpo("hinge").losses, [0.8, 1.0, 1.4])
    close(dpo("hinge", beta=1.0).losses, [0.0, 1.0, 5.0])


def test_each_dpo_loss_type_gives_different_losses():
    losses = {kind: dpo(kind, 0.1 if kind == "robust" else 0.0).losses for kind in DPO_LOSS_TYPES}
    losses["sigmoid_smoothed"] = dpo("sigmoid", 0.1).losses
    names = list(losses)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.allclose(losses[a], losses[b], atol=1e-3), (a, b)


def test_dpo_gradient_reaches_policy_only():
    pc, pr = t(*PC, grad=True), t(*PR, grad=True)
    rc, rr = t(*RC, grad=True), t(*RR, grad=True)
    out = dpo_loss(pc, pr, rc, rr, beta=BETA)
    out.losses.sum().backward()
    # d/dpc softplus(-beta * logits) = -beta * sigmoid(-beta * logits); d/dpr is its negative
    expected = [-BETA * sigmoid(-BETA * x) for x in LOGITS]
    close(pc.grad, expected)
    close(pr.grad, [-g for g in expected])
    assert rc.grad is None and rr.grad is None
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad


def test_dpo_computes_in_float32_from_bfloat16():
    out = dpo_loss(*(t(*v).bfloat16() for v in (PC, PR, RC, RR)), beta=BETA)
    assert out.losses.dtype == torch.float32 and out.chosen_rewards.dtype == torch.float32
    close(out.losses, [softplus(-0.2), math.log(2.0), softplus(0.4)])


def test_orpo_closed_form_log_odds():
    # p_c = 1/2 -> odds 1; p_r = 1/4 -> odds 1/3: log odds ratio = ln 3, sigmoid(ln 3) = 3/4.
    # p_c = 0.9 -> odds 9;  p_r = 0.6 -> odds 1.5: log odds ratio = ln 6, sigmoid(ln 6) = 6/7.
    beta = 0.1
    pc = t(math.log(0.5), math.log(0.9), grad=True)
    pr = t(math.log(0.25), math.log(0.6), grad=True)
    out = orpo_loss(pc, pr, beta=beta)
    close(out.extras["log_odds_chosen"], [math.log(3.0), math.log(6.0)])
    close(out.extras["log_odds_ratio"], [math.log(0.75), math.log(6 / 7)])
    close(out.extras["nll_loss"], [math.log(2.0), -math.log(0.9)])
    close(
        out.losses, [math.log(2.0) - beta * math.log(0.75), -math.log(0.9) - beta * math.log(6 / 7)]
    )
    close(out.chosen_rewards, [beta * math.log(0.5), beta * math.log(0.9)])
    close(out.rejected_rewards, [beta * math.log(0.25), beta * math.log(0.6)])
    out.losses.sum().backward()
    assert pc.grad is not None and pr.grad is not None
    assert not any(v.requires_grad for v in (out.chosen_rewards, *out.extras.values()))


def test_orpo_log_odds_stable_near_probability_one():
    pc_value = -1e-9
    # the naive form cancels to log(0) in float32; the stable one must not
    assert torch.isinf(torch.log1p(-torch.exp(t(pc_value)))).all()
    pc = t(pc_value, 0.0, grad=True)
    pr = t(math.log(0.5), math.log(0.5), grad=True)
    out = orpo_loss(pc, pr, beta=0.2)
    out.losses.sum().backward()
    for tensor in (out.losses, out.extras["log_odds_chosen"], pc.grad, pr.grad):
        assert torch.isfinite(tensor).all(), tensor
    pc32 = torch.tensor(pc_value, dtype=torch.float32).item()  # the value the tensor really holds
    expected = (pc32 - math.log(0.5)) - (math.log(-math.expm1(pc32)) - math.log(0.5))
    assert out.extras["log_odds_chosen"][0].item() == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx(-math.log(1e-9), rel=1e-6)  # ~20.72: p_c/(1 - p_c) ~ 1e9


def test_simpo_hand_values_with_margin_and_smoothing():
    beta, gamma = 2.0, 0.5
    pc, pr = t(-1.0, -2.0, grad=True), t(-1.5, -1.0)
    out = simpo_loss(pc, pr, beta=beta, gamma=gamma)
    # logits = beta * (pc - pr) - gamma = 0.5, -2.5
    close(out.losses, [softplus(-0.5), softplus(2.5)])
    close(out.chosen_rewards, [-2.0, -4.0])
    close(out.rejected_rewards, [-3.0, -2.0])
    smoothed = simpo_loss(pc, pr, beta=beta, gamma=gamma, label_smoothing=0.2)
    close(smoothed.losses, [0.8 * softplus(-x) + 0.2 * softplus(x) for x in (0.5, -2.5)])
    no_margin = simpo_loss(pc, pr, beta=beta, gamma=0.0)
    close(no_margin.losses, [softplus(-1.0), softplus(2.0)])
    out.losses.sum().backward()
    close(pc.grad, [-beta * sigmoid(-0.5), -beta * sigmoid(2.5)])


def test_kto_kl_is_detached_log_ratio():
    policy = t(-10.0, -4.0, -7.0, grad=True)
    kl = kto_kl(policy, t(-12.0, -3.0, -7.5))
    close(kl, [2.0, -1.0, 0.5])
    assert not kl.requires_grad


def test_kto_weights_and_reference_point():
    beta, z0, w_d, w_u = 0.1, 2.0, 1.33, 0.5
    policy = t(-10.0, -10.0, -30.0, grad=True)
    reference = t(-15.0, -15.0, -20.0, grad=True)
    desirable = torch.tensor([True, False, False])
    out = kto_loss(
        policy, reference, desirable, kl=z0, beta=beta, desirable_weight=w_d, undesirable_weight=w_u
    )
    # r = 5, 5, -10
    expected = [
        w_d * (1 - sigmoid(beta * (5 - z0))),
        w_u * (1 - sigmoid(beta * (z0 - 5))),
        w_u * (1 - sigmoid(beta * (z0 + 10))),
    ]
    close(out.losses, expected)
    close(out.rewards, [0.5, 0.5, -1.0])
    out.losses.sum().backward()
    assert policy.grad is not None and reference.grad is None and not out.rewards.requires_grad
    # d/dr of w (1 - sigmoid(beta (r - z0))) = -w beta s (1 - s); the undesirable sign is flipped
    s0, s2 = sigmoid(beta * 3), sigmoid(beta * 12)
    close(
        policy.grad,
        [-w_d * beta * s0 * (1 - s0), w_u * beta * s0 * (1 - s0), w_u * beta * s2 * (1 - s2)],
    )


def test_kto_reference_point_from_mismatched_pairs_as_tensor():
    beta = 0.5
    kl_pairs = kto_kl(t(-10.0, -4.0), t(-12.0, -3.0))  # log-ratios 2, -1
    z0 = kl_pairs.mean().clamp(min=0)  # what the caller does over the global batch
    assert z0.item() == pytest.approx(0.5)
    z0_with_grad = z0.clone().requires_grad_(True)
    out = kto_loss(t(-5.0, grad=True), t(-6.0), torch.tensor([True]), kl=z0_with_grad, beta=beta)
    close(out.losses, [1 - sigmoid(beta * (1.0 - 0.5))])
    out.losses.sum().backward()
    assert z0_with_grad.grad is None
    zero_point = kto_loss(t(-5.0), t(-6.0), torch.tensor([True]), kl=0.0, beta=beta)
    close(zero_point.losses, [1 - sigmoid(beta * 1.0)])


@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_beta_is_rejected_everywhere(beta):
    pair = (t(-1.0), t(-2.0))
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*pair, *pair, beta=beta)
    with pytest.raises(ValueError, match="beta"):
        orpo_loss(*pair, beta=beta)
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(*pair, beta=beta, gamma=0.5)
    with pytest.raises(ValueError, match="beta"):
        kto_loss(*pair, torch.tensor([True]), kl=0.0, beta=beta)


@pytest.mark.parametrize("label_smoothing", [0.5, -0.1, 1.0])
def test_bad_label_smoothing_is_rejected(label_smoothing):
    pair = (t(-1.0), t(-2.0))
    with pytest.raises(ValueError, match=r"label_smoothing.*\[0, 0\.5\)"):
        dpo_loss(*pair, *pair, beta=0.1, loss_type="robust", label_smoothing=label_smoothing)
    with pytest.raises(ValueError, match="label_smoothing"):
        simpo_loss(*pair, beta=2.0, gamma=0.5, label_smoothing=label_smoothing)


def test_bad_dpo_arguments_are_rejected():
    pair = (t(-1.0), t(-2.0))
    with pytest.raises(ValueError, match="sigmoid, robust, ipo, hinge"):
        dpo_loss(*pair, *pair, beta=0.1, loss_type="sigmod")
    for kind in ("ipo", "hinge"):
        with pytest.raises(ValueError, match=f"{kind}.*label smoothing"):
            dpo_loss(*pair, *pair, beta=0.1, loss_type=kind, label_smoothing=0.1)
    with pytest.raises(ValueError, match="1-D of equal length"):
        dpo_loss(t(-1.0, -2.0), t(-1.0), *pair, beta=0.1)
    with pytest.raises(ValueError, match="1-D"):
        orpo_loss(torch.zeros(2, 2), torch.zeros(2, 2), beta=0.1)


def test_bad_simpo_and_kto_arguments_are_rejected():
    pair = (t(-1.0, -2.0), t(-2.0, -3.0))
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(*pair, beta=2.0, gamma=-0.5)
    with pytest.raises(ValueError, match="desirable must be a bool tensor"):
        kto_loss(*pair, torch.tensor([1, 0]), kl=0.0, beta=0.1)
    with pytest.raises(ValueError, match="desirable must be a bool tensor"):
        kto_loss(*pair, torch.tensor([True]), kl=0.0, beta=0.1)
    with pytest.raises(ValueError, match="kl must be a scalar"):
        kto_loss(*pair, torch.tensor([True, False]), kl=torch.zeros(2), beta=0.1)
    with pytest.raises(ValueError, match="clamp"):
        kto_loss(*pair, torch.tensor([True, False]), kl=-0.3, beta=0.1)
    with pytest.raises(ValueError, match="undesirable_weight"):
        kto_loss(*pair, torch.tensor([True, False]), kl=0.0, beta=0.1, undesirable_weight=0.0)
