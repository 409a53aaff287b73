"""Loss functions against hand-computed values and an independent implementation."""

import math

import pytest
import torch
import torch.nn.functional as F

from keel.losses import chunked_cross_entropy, cross_entropy_sum


def test_cross_entropy_sum_matches_hand_value():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # [1, 2, 2]
    targets = torch.tensor([[1, -100]])
    # softmax([0, ln 3]) = [1/4, 3/4] -> -ln(3/4); the second position is ignored
    assert cross_entropy_sum(logits, targets).item() == pytest.approx(-math.log(0.75), rel=1e-6)


def test_chunked_matches_full_loss_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[::5] = -100
    ref = F.cross_entropy(head(hidden), targets, ignore_index=-100, reduction="sum")
    ref.backward()
    ref_hidden, ref_weight = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    got = chunked_cross_entropy(hidden, targets, head, chunk_size=8)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, ref_weight, rtol=1e-5, atol=1e-6)


def test_chunked_without_grad():
    head = torch.nn.Linear(4, 6)
    hidden, targets = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 4])
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(hidden, targets, head, chunk_size=2),
            cross_entropy_sum(head(hidden), targets),
        )
