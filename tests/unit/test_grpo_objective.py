"""The grpo objective against a hand-written computation from the model's full logits.

Each expected value runs every rollout sequence alone through the Hugging Face forward,
divides its logits by the temperature, takes log_softmax and gathers the completion tokens;
keel.losses.grpo (tested on its own against hand values) then gives the losses. The
objective must agree in loss, gradient, count and statistics, whatever its path: padded or
padding-free micro-batches, fast head or full forward, a reference with LoRA adapters off
or a frozen copy, old log-probs from the batch (num_iterations > 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from keel.data import collate
from keel.losses.grpo import aggregate, policy_token_losses
from keel.stages.grpo import CLIP_METRICS, GrpoSettings
from keel.train.grpo_objective import PolicyGradientObjective
from keel.train.preference import SequenceScorer
from tests.conftest import build_tiny_model

# (prompt, completion, advantage): two prompts x two samples, ragged completion lengths
ROLLOUTS = [
    ([5, 17, 40, 9], [21, 22, 23, 2], 0.7),
    ([5, 17, 40, 9], [44, 2], -0.7),
    ([7, 81, 33], [90, 91, 92, 93, 94, 2], 1.1),
    ([7, 81, 33], [60], -1.1),
]
TEMPERATURE = 0.7


def rollout_row(prompt: list[int], completion: list[int], advantage: float) -> dict:
    """A rollout row as keel.train.rollouts lays it: targets on the completion only."""
    ids = prompt + completion
    trained = [False] * len(prompt) + [True] * len(completion)
    targets = [ids[i + 1] if trained[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
    return {
        "input_ids": ids,
        "targets": targets,
        "position_ids": list(range(len(ids))),
        "prompt_len": len(prompt),  # padding-free: each prompt computed once
        "num_targets": len(completion),
        "advantages": [advantage],
    }


def rows(old_shift: float | None = None) -> list[dict]:
    """The rollout rows; with `old_shift`, old log-probs that differ from the policy's (the
    policy's own, taken by `hand_logps`, moved by +-old_shift alternately)."""
    out = [rollout_row(*r) for r in ROLLOUTS]
    if old_shift is not None:
        model = build_tiny_model(vocab_size=128, seed=3)
        for row, logps in zip(out, hand_logps(model, out)):
            values = iter(logps.tolist())
            row["old_logps"] = [
                next(values) + old_shift * (-1) ** i if t != -100 else 0.0
                for i, t in enumerate(row["targets"])
            ]
    return out


def hand_logps(model, batch_rows: list[dict], temperature: float = TEMPERATURE) -> list:
    """Each row's completion log-probs, the row alone through the full forward: [n] each."""
    out = []
    for row in batch_rows:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0].float()  # [T, V]
        logps = (logits / temperature).log_softmax(-1)  # [T, V]
        positions = [i for i, t in enumerate(row["targets"]) if t != -100]
        targets = torch.tensor([row["targets"][i] for i in positions])
        out.append(logps[positions].gather(-1, targets[:, None])[:, 0])  # [n]
    return out


def hand_loss(model, batch_rows, settings: GrpoSettings, reference=None):
    """(loss sum, TokenLosses) from the full logits and keel.losses.grpo."""
    per_row = hand_logps(model, batch_rows, settings.temperature)
    logps = torch.cat(per_row)  # [N]
    sequence = torch.cat([torch.full((len(x),), s) for s, x in enumerate(per_row)])  # [N]
    advantages = torch.tensor([row["advantages"][0] for row in batch_rows])[sequence]
    if "old_logps" in batch_rows[0]:
        old = torch.tensor(
            [v for row in batch_rows for v, t in zip(row["old_logps"], row["targets"]) if t != -100]
        )
    else:
        old = logps.detach()
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = torch.cat(hand_logps(reference, batch_rows, settings.temperature))
    out = policy_token_losses(
        logps,
        old,
        advantages,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.clip_high,
        ref_logps=ref,
        beta=settings.beta,
    )
    loss = aggregate(
        settings.loss_type, out.losses, sequence, len(batch_rows), settings.max_completion_length
    )
    return loss, out


def gradients(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def assert_matches_hand(objective, model, batch, settings, reference=None, batch_rows=None):
    out = objective(batch)
    out.loss.backward()
    got = gradients(model)
    want_loss, want = hand_loss(model, batch_rows or rows(), settings, reference)
    want_loss.backward()
    expected = gradients(model)
    assert out.loss.item() == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-6)
    assert len(got) == len(expected) > 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    return out, want


def fast(objective: PolicyGradientObjective) -> PolicyGradientObjective:
    """The objective on its fast head (set-up switches it on after its check passed)."""
    objective.fast_head = True
    return objective


@pytest.fixture
def model():
    return build_tiny_model(vocab_size=128, seed=3).eval()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("fast_head", [True, False])
def test_loss_and_gradient_equal_the_full_logits_computation(model, loss_type, fast_head):
    settings = GrpoSettings(loss_type=loss_type, temperature=TEMPERATURE, max_completion_length=8)
    objective = PolicyGradientObjective(model, settings=settings, chunk_size=5)
    objective.fast_head = fast_head
    out, _ = assert_matches_hand(objective, model, collate(rows(), 0), settings)
    completion_tokens = sum(len(r[1]) for r in ROLLOUTS)
    assert out.count.item() == (completion_tokens if loss_type == "dapo" else len(ROLLOUTS))
    assert objective.metric_names == CLIP_METRICS
    # one update per rollout: the ratio is 1, nothing is clipped
    assert out.statistics.tolist() == [0.0, completion_tokens] * 3


def test_padding_free_equals_padded(model):
    """Padding-free, each prompt runs once for its completions (keel.data.shared_prompt):
    the same loss, statistics and gradients as padded rows (old log-probs from the batch,
    so clipping acts), with fewer tokens; the completions seeing each other (the groups
    read as plain samples) moves the loss: the negative control."""
    from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
    from keel.train.objective import use_attention

    settings = GrpoSettings(loss_type="grpo", temperature=TEMPERATURE)
    objective = fast(PolicyGradientObjective(model, settings=settings, chunk_size=5))
    padded = objective(collate(rows(2.0), 0))
    padded.loss.backward()
    want = gradients(model)
    register_varlen_attention()
    use_attention(model, VARLEN_ATTENTION)
    batch = collate(rows(2.0), 0, padding_free=True)
    assert batch["input_ids"].shape[1] == 3 + 5 + 3 + 2 + 7 + 2  # prompts once: not 27
    merged = objective(batch)
    merged.loss.backward()
    assert merged.loss.item() == pytest.approx(padded.loss.item(), rel=1e-5)
    assert merged.statistics.tolist() == padded.statistics.tolist()
    assert merged.count.item() == padded.count.item() == len(ROLLOUTS)
    for g, e in zip(gradients(model), want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        leaky = objective({**batch, "prefix_groups": None})
    assert abs(leaky.loss.item() - padded.loss.item()) > 1e-3 * abs(padded.loss.item())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_old_logps_from_the_batch_move_the_ratio_and_clip(model, loss_type):
    """num_iterations > 1: the batch's old log-probs (here +-0.5 off the policy's) make the
    ratio exp(+-0.5), far outside [0.8, 1.2]: both clip bounds are met."""
    settings = GrpoSettings(loss_type=loss_type, temperature=TEMPERATURE, num_iterations=2)
    objective = fast(PolicyGradientObjective(model, settings=settings, chunk_size=5))
    batch_rows = rows(0.5)
    out, want = assert_matches_hand(
        objective, model, collate(batch_rows, 0), settings, batch_rows=batch_rows
    )
    low, high = want.low_clipped.sum().item(), want.high_clipped.sum().item()
    assert low > 0 and high > 0
    tokens = float(want.losses.shape[0])
    assert out.statistics.tolist() == [low, tokens, high, tokens, low + high, tokens]


def _perturbed(model):
    """A different model of the same shape: the reference the policy has moved from."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return other


def test_beta_with_a_frozen_copy_adds_the_kl_to_it(model):
    settings = GrpoSettings(temperature=TEMPERATURE, beta=0.3)
    reference_model = _perturbed(model).requires_grad_(False)
    scorer = SequenceScorer(reference_model, chunk_size=5, fast_head=True)
    objective = fast(
        PolicyGradientObjective(model, settings=settings, reference=scorer, chunk_size=5)
    )
    assert objective.metric_names == (*CLIP_METRICS, "kl")
    out, want = assert_matches_hand(
        objective, model, collate(rows(), 0), settings, reference=reference_model
    )
    kl_sum, kl_count = out.statistics.tolist()[-2:]
    assert kl_sum == pytest.approx(want.kl.sum().item(), rel=1e-5) and kl_sum > 0
    assert kl_count == want.losses.shape[0]


def test_beta_with_lora_uses_the_policy_with_adapters_off(model):
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(model, lora)
    with torch.no_grad():  # trained adapters: the policy is no longer the base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.3)
    settings = GrpoSettings(temperature=TEMPERATURE, beta=0.3, loss_type="dr_grpo")
    objective = fast(PolicyGradientObjective(policy, settings=settings, chunk_size=5))
    base = _Base(policy)
    out, want = assert_matches_hand(objective, policy, collate(rows(), 0), settings, base)
    assert out.statistics.tolist()[-2] == pytest.approx(want.kl.sum().item(), rel=1e-5)
    assert want.kl.sum().item() > 0


class _Base(torch.nn.Module):
    """The PEFT model with its adapters off, as a model (what the hand computation calls)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


@pytest.mark.parametrize("padding_free", [False, True])
def test_collate_gives_rollout_rows_their_advantages_and_old_logps(padding_free):
    batch_rows = rows(0.5)
    batch = collate(batch_rows, 0, padding_free=padding_free)
    assert batch["advantages"].tolist() == pytest.approx([r[2] for r in ROLLOUTS])
    mask = batch["targets"] != -100
    sequence = batch["sequence_index"][mask]
    assert sequence.tolist() == [s for s, r in enumerate(ROLLOUTS) for _ in r[1]]
    want = [v for row in batch_rows for v, t in zip(row["old_logps"], row["targets"]) if t != -100]
    assert batch["old_logps"][mask].tolist() == pytest.approx(want)
    assert batch["old_logps"][~mask].abs().sum().item() == 0.0  # prompts and padding
    assert "old_logps" not in collate(rows(), 0, padding_free=padding_free)


def test_token_logps_mode_gives_what_old_logps_hold(model):
    """The rollout source keeps mode="token_logps" as old log-probs: fed back, the ratio is
    1 and the loss equals the loss without them (num_iterations 1)."""
    settings = GrpoSettings(temperature=TEMPERATURE, num_iterations=2)
    objective = fast(PolicyGradientObjective(model, settings=settings, chunk_size=5))
    batch = collate(rows(), 0)
    with torch.no_grad():
        flat = objective(batch, mode="token_logps")  # [N]
    want = torch.cat(hand_logps(model, rows()))
    torch.testing.assert_close(flat, want, rtol=1e-5, atol=1e-6)
    mask = batch["targets"] != -100
    old = torch.zeros(mask.shape)
    old[mask] = flat
    with torch.no_grad():
        reused = objective(batch | {"old_logps": old})
        fresh = objective(batch)
    assert reused.loss.item() == pytest.approx(fresh.loss.item(), abs=1e-6)
    assert reused.statistics.tolist() == fresh.statistics.tolist()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_masked_completions_weigh_zero_and_count_nothing(model, loss_type):
    """mask_truncated_completions: a masked completion (kept 0) changes neither the loss nor
    the gradient nor the counts, versus leaving it out; a micro-batch of only masked rows
    still runs backward (zero gradients), so no rank skips a parameter."""
    settings = GrpoSettings(rewards=["r.py:f"], loss_type=loss_type, temperature=TEMPERATURE)
    objective = fast(PolicyGradientObjective(model, settings=settings))
    masked = [dict(row, kept=[0.0 if i == 2 else 1.0]) for i, row in enumerate(rows())]
    out = objective(collate(masked, 0))
    out.loss.backward()
    got = gradients(model)
    # the same three completions, the masked one's tokens in no count
    others = [r for i, r in enumerate(rows()) if i != 2]
    want_loss, _ = hand_loss(model, others, settings)
    if loss_type == "grpo":  # per completion, and the masked one still counts as one
        assert out.count.item() == 4
    else:
        assert out.count.item() == sum(r["num_targets"] for r in others)
    assert out.loss.item() == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-6)
    want_loss.backward()
    for g, e in zip(got, gradients(model)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    all_masked = [dict(row, kept=[0.0]) for row in rows()]
    out = objective(collate(all_masked, 0))
    out.loss.backward()  # connected to the graph, value 0
    assert out.loss.item() == 0.0 and all(g.abs().max() == 0 for g in gradients(model))
