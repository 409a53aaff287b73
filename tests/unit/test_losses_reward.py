"""Bradley-Terry reward-model loss against hand values and TRL 1.16's RewardTrainer."""

import math
import types
from collections import defaultdict

import pytest
import torch

from keel.losses.reward import bradley_terry_loss


def t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


def softplus(x: float) -> float:
    """-logsigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def close(tensor: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    assert tensor.tolist() == pytest.approx(expected, rel=tol, abs=tol)


def test_bradley_terry_by_hand():
    chosen, rejected = t(2.0, 0.0, -1.0, grad=True), t(1.0, 0.5, -1.0)
    out = bradley_terry_loss(chosen, rejected)
    close(out.losses, [softplus(-1.0), softplus(0.5), math.log(2)])
    close(out.margin, [1.0, -0.5, 0.0])
    assert out.accuracy.tolist() == [1.0, 0.0, 0.0]  # a tie is not a win
    out.losses.sum().backward()
    # d/dc -logsigmoid(c - r) = -sigmoid(r - c)
    close(chosen.grad, [-1 / (1 + math.e), -1 / (1 + math.exp(-0.5)), -0.5])


def test_margin_and_centering_by_hand():
    chosen, rejected = t(2.0, 0.0), t(1.0, 0.5)
    out = bradley_terry_loss(chosen, rejected, margin=t(0.5, 1.0), center_coefficient=0.1)
    # -logsigmoid(gap - margin) + 0.1 * (c + r)^2
    close(out.losses, [softplus(-0.5) + 0.1 * 9.0, softplus(1.5) + 0.1 * 0.25])
    close(out.margin, [1.0, -0.5])  # the scores' gap, the margin column aside


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="equal length"):
        bradley_terry_loss(t(1.0, 2.0), t(1.0))
    with pytest.raises(ValueError, match="margin"):
        bradley_terry_loss(t(1.0), t(0.0), margin=t(1.0, 2.0))
    with pytest.raises(ValueError, match="center_coefficient"):
        bradley_terry_loss(t(1.0), t(0.0), center_coefficient=-1.0)


class _ScoreModel(torch.nn.Module):
    """Returns fixed scores for chosen rows then rejected rows, as a seq-cls model would."""

    def __init__(self, scores: torch.Tensor):
        super().__init__()
        self.scores = torch.nn.Parameter(scores.clone())

    def forward(self, input_ids, attention_mask, **kwargs):
        return types.SimpleNamespace(logits=self.scores.unsqueeze(-1))


@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("use_margin", [False, True])
def test_loss_and_metrics_equal_trls_reward_trainer(center, use_margin):
    from trl import RewardTrainer

    chosen, rejected = t(0.3, -0.2, 1.5, 0.0), t(0.1, 0.4, -0.5, 0.0)
    margin = t(0.5, 0.0, 1.0, 0.25)
    model = _ScoreModel(torch.cat([chosen, rejected]))
    stub = types.SimpleNamespace(
        model=model,
        args=types.SimpleNamespace(center_rewards_coefficient=center),
        accelerator=types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x),
        _total_train_tokens=0,
        _tp_size=1,
        _metrics={"train": defaultdict(list)},
    )
    ids = torch.zeros(8, 3, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if use_margin:
        inputs["margin"] = margin
    trl_loss = RewardTrainer.compute_loss(stub, model, dict(inputs))
    (trl_grad,) = torch.autograd.grad(trl_loss, model.scores)

    scores = model.scores
    out = bradley_terry_loss(
        scores[:4],
        scores[4:],
        margin=margin if use_margin else None,
        center_coefficient=center or 0.0,
    )
    keel_loss = out.losses.sum() / 4  # the trainer divides the sum by the global pair count
    (keel_grad,) = torch.autograd.grad(keel_loss, scores)
    torch.testing.assert_close(keel_loss, trl_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(keel_grad, trl_grad, rtol=1e-6, atol=1e-7)
    metrics = stub._metrics["train"]
    assert out.accuracy.mean().item() == pytest.approx(metrics["accuracy"][-1])
    assert out.margin.mean().item() == pytest.approx(metrics["margin"][-1], rel=1e-6)
