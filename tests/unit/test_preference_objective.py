"""The preference objective: per-sequence log-probs, the reference, statistics, normalisation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, OFTConfig, get_peft_model

from keel.data import collate
from keel.precision import Precision
from keel.stages.base import ObjectiveOutput
from keel.stages.registry import get_stage
from keel.train.loop import Trainer
from keel.train.preference import (
    PreferenceObjective,
    SequenceScorer,
    reduce_statistics,
    score_sequences,
)
from tests.conftest import build_tiny_model

PROMPTS = [[5, 17, 40, 9], [7, 7, 81, 33, 12, 4], [60, 3]]
CHOSEN = [[21, 22, 23, 2], [44, 45, 2], [90, 91, 92, 93, 2]]
REJECTED = [[31, 2], [54, 55, 56, 57, 2], [99, 2]]


def sequence_parts(prompt: list[int], completion: list[int]) -> tuple[list, list, list]:
    """(input_ids, targets, position_ids) of one sequence: targets on the completion only."""
    ids = prompt + completion
    trained = [False] * len(prompt) + [True] * len(completion)
    targets = [ids[i + 1] if trained[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
    return ids, targets, list(range(len(ids)))


def row_of(sequences: list[tuple[list[int], list[int]]], labels: list[int], units: int) -> dict:
    row = {"input_ids": [], "targets": [], "position_ids": [], "labels": labels}
    for prompt, completion in sequences:
        for key, part in zip(
            ("input_ids", "targets", "position_ids"), sequence_parts(prompt, completion)
        ):
            row[key] += part
    row["num_targets"] = units
    return row


def pair_rows() -> list[dict]:
    return [row_of([(p, c), (p, r)], [1, 0], 1) for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)]


def packed_row() -> dict:
    sequences = [s for p, c, r in zip(PROMPTS, CHOSEN, REJECTED) for s in ((p, c), (p, r))]
    return row_of(sequences, [1, 0] * len(PROMPTS), len(PROMPTS))


def alone_logp(model, prompt: list[int], completion: list[int]) -> float:
    """The completion's summed log-prob, running the sequence alone through the HF forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logps = model(input_ids=ids).logits.float().log_softmax(-1)[0]  # [T, V]
    return sum(logps[len(prompt) - 1 + i, token].item() for i, token in enumerate(completion))


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=128, seed=3).eval()


@pytest.mark.parametrize("fast_head", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_sequence_logps_equal_each_sequence_alone(model, fast_head, packed):
    rows = [packed_row()] if packed else pair_rows()
    with torch.no_grad():
        scored = score_sequences(model, collate(rows, 0), fast_head=fast_head, chunk_size=5)
    expected = [
        alone_logp(model, p, c) for p, ch, r in zip(PROMPTS, CHOSEN, REJECTED) for c in (ch, r)
    ]
    assert scored.sums.tolist() == pytest.approx(expected, rel=1e-5)
    lengths = [len(c) for ch, r in zip(CHOSEN, REJECTED) for c in (ch, r)]
    assert scored.counts.tolist() == lengths


def test_sequence_logps_negative_control(model):
    """A packed row whose positions did not restart mixes the sequences: the test above
    would catch it."""
    row = packed_row()
    row["position_ids"] = list(range(len(row["input_ids"])))
    batch = collate([row], 0)
    batch["sequence_index"] = collate([packed_row()], 0)["sequence_index"]
    with torch.no_grad():
        scored = score_sequences(model, batch, fast_head=True, chunk_size=64)
    expected = alone_logp(model, PROMPTS[1], CHOSEN[1])
    assert abs(scored.sums[2].item() - expected) > 1e-3


def lora(model, seed: int = 0, perturb: bool = False):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(seed)  # LoRA A is drawn at random
    return _moved(get_peft_model(copy.deepcopy(model), config), "lora_B", 0.5, seed, perturb)


def oft(model, seed: int = 0, perturb: bool = False):
    config = OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(copy.deepcopy(model), config)  # zero: the identity rotation
    return _moved(peft_model, ".oft_R.", 0.2, seed, perturb)


def _moved(peft_model, part: str, scale: float, seed: int, perturb: bool):
    """`peft_model` with the adapter weights named `part` (zero at the start: the adapter
    changes nothing) drawn at random when `perturb`."""
    if perturb:
        generator = torch.Generator().manual_seed(seed)
        for name, p in peft_model.named_parameters():
            if part in name:
                p.data = torch.randn(p.shape, generator=generator) * scale
    return peft_model


ADAPTERS = {"lora": lora, "oft": oft}


def parts(out: ObjectiveOutput) -> tuple:
    return out.loss, out.count, out.statistics


def objective(policy, stage="dpo", **settings) -> PreferenceObjective:
    record = get_stage(stage)
    built = PreferenceObjective(policy, stage=record, settings=record.settings(**settings))
    ok, why = built.check_fast_head()
    assert ok, why
    built.fast_head = True
    return built


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_dpo_with_an_adapter_starts_at_ln2_with_zero_margins(model, adapter):
    """At step 1 the LoRA policy (B = 0) or OFT policy (no rotation) is its own reference:
    every pair's loss is ln 2."""
    built = objective(ADAPTERS[adapter](model))
    loss_sum, pairs, stats = parts(built(collate(pair_rows(), 0)))
    assert pairs.item() == 3
    assert loss_sum.item() / 3 == pytest.approx(math.log(2), rel=1e-6)
    named = reduce_statistics(built.metric_names, stats.tolist())
    assert named["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert named["rewards/accuracies"] == 0.0
    expected_chosen = sum(alone_logp(model, p, c) for p, c in zip(PROMPTS, CHOSEN)) / 3
    assert named["logps/chosen"] == pytest.approx(expected_chosen, rel=1e-5)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_reference_equals_a_separately_loaded_base(model, adapter):
    policy = ADAPTERS[adapter](model, perturb=True)
    built = objective(policy)
    batch = collate(pair_rows(), 0)
    reference, _ = built(batch, mode="reference")
    separate = SequenceScorer(copy.deepcopy(model), chunk_size=8, fast_head=True)(batch)
    assert reference.tolist() == pytest.approx(separate.tolist(), rel=1e-6)
    with torch.no_grad():
        trained = score_sequences(policy, batch, fast_head=True, chunk_size=8).sums
    assert (trained - reference).abs().max() > 1e-3  # the adapters do change the policy


def test_precomputed_reference_gives_the_live_loss(model):
    built = objective(lora(model, perturb=True))
    rows = pair_rows()
    live_loss, _, live_stats = parts(built(collate(rows, 0)))
    reference, _ = built(collate(rows, 0), mode="reference")
    at = 0
    for row in rows:
        row["reference_logps"] = reference[at : at + 2].tolist()
        at += 2
    loss, _, stats = parts(built(collate(rows, 0)))
    assert loss.item() == pytest.approx(live_loss.item(), rel=1e-6)
    assert stats.tolist() == pytest.approx(live_stats.tolist(), rel=1e-6)
    rows[0]["reference_logps"] = [0.0, 0.0]  # negative control: the reference is used
    assert built(collate(rows, 0)).loss.item() != pytest.approx(live_loss.item(), rel=1e-3)


def test_orpo_nll_is_minus_mean_chosen_logp(model):
    built = objective(copy.deepcopy(model), stage="orpo", beta=0.1)
    stats = built(collate(pair_rows(), 0)).statistics
    named = reduce_statistics(built.metric_names, stats.tolist())
    assert named["nll_loss"] == pytest.approx(-named["logps/chosen"], rel=1e-6)
    per_token = [alone_logp(model, p, c) / len(c) for p, c in zip(PROMPTS, CHOSEN)]
    assert named["logps/chosen"] == pytest.approx(sum(per_token) / 3, rel=1e-5)
    assert named["rewards/chosen"] == pytest.approx(0.1 * named["logps/chosen"], rel=1e-6)


def kto_rows() -> list[dict]:
    """Three samples, each with its mismatched sequence (prompt i, completion i+1)."""
    rows = []
    completions = CHOSEN
    for i, (p, c) in enumerate(zip(PROMPTS, completions)):
        row = row_of([(p, c)], [int(i != 1)], 1)
        other = completions[(i + 1) % len(completions)]
        kl = row_of([(p, other)], [0], 1)
        row |= {f"kl_{k}": kl[k] for k in ("input_ids", "targets", "position_ids")}
        rows.append(row)
    return rows


def test_kto_statistic_and_loss(model):
    built = objective(lora(model, perturb=True), stage="kto", beta=0.5)
    batch = collate(kto_rows(), 0)
    total, count = built(batch, mode="statistic")
    assert count.item() == 3
    with torch.no_grad():
        policy_kl = score_sequences(built.model, batch, prefix="kl_", fast_head=True, chunk_size=8)
    reference_kl = SequenceScorer(copy.deepcopy(model), chunk_size=8, fast_head=True)(batch, "kl_")
    assert total.item() == pytest.approx((policy_kl.sums - reference_kl).sum().item(), rel=1e-5)
    built.set_window_statistic(total.item() / 3)
    loss_sum, samples, stats = parts(built(batch))
    assert samples.item() == 3
    named = reduce_statistics(built.metric_names, stats.tolist())
    assert set(named) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }
    # by hand: sample 1 is undesirable, 0 and 2 desirable
    with torch.no_grad():
        policy = score_sequences(built.model, batch, fast_head=True, chunk_size=8).sums
    reference = SequenceScorer(copy.deepcopy(model), chunk_size=8, fast_head=True)(batch)
    z0 = max(0.0, total.item() / 3)
    ratio = (policy - reference).tolist()
    expected = sum(
        1 - 1 / (1 + math.exp(-0.5 * ((r - z0) if d else (z0 - r))))
        for r, d in zip(ratio, (True, False, True))
    )
    assert loss_sum.item() == pytest.approx(expected, rel=1e-5)
    assert named["rewards/rejected"] == pytest.approx(0.5 * ratio[1], rel=1e-5)


def trainer_for(policy, stage="dpo") -> Trainer:
    built = objective(policy, stage=stage)
    trainable = [p for p in built.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1.0)
    return Trainer(
        objective=built,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        precision=Precision("fp32", "test"),
        device=torch.device("cpu"),
        pad_id=0,
        max_grad_norm=0.0,
    )


@pytest.mark.parametrize("stage", ["dpo", "simpo", "kto"])
def test_accumulation_normalises_per_pair(model, stage):
    """One micro-batch of 3 pairs, or micro-batches of 1 and 2 pairs: the same update and the
    same statistics (each pair weighs 1/3 wherever it lands)."""
    rows = kto_rows() if stage == "kto" else pair_rows()
    whole = dict(window_targets=3, window_tokens=0, filler=rows[0])
    one, split = lora(model, perturb=True), lora(model, perturb=True)
    r_one = trainer_for(one, stage).train_step([rows], **whole)
    r_split = trainer_for(split, stage).train_step([rows[:1], rows[1:]], **whole)
    assert r_one.loss_sum.item() == pytest.approx(r_split.loss_sum.item(), rel=1e-5)
    assert r_one.statistics.tolist() == pytest.approx(r_split.statistics.tolist(), rel=1e-5)
    for (name, a), b in zip(one.named_parameters(), split.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    moved = [
        (a - b).abs().max().item()
        for a, b in zip(one.parameters(), lora(model, perturb=True).parameters())
    ]
    assert max(moved) > 1e-4  # it trained at all
    # Negative control: normalising each micro-batch by its own pairs (a mean of means)
    # weighs the lone pair twice as much, and these rows tell the difference.
    built = objective(lora(model, perturb=True), stage=stage)
    if stage == "kto":
        built.set_window_statistic(r_one.window_statistic)
    with torch.no_grad():
        per_pair = [built(collate([row], 0)).loss.item() for row in rows]
    mean_of_means = (per_pair[0] + (per_pair[1] + per_pair[2]) / 2) / 2
    assert abs(mean_of_means - sum(per_pair) / 3) > 50 * 1e-5 * abs(
        sum(per_pair) / 3
    )  # vs rel=1e-5


@pytest.mark.parametrize("stage", ["dpo", "orpo", "simpo"])
def test_pairs_sharing_their_prompt_train_as_their_sequences_laid_end_to_end(model, stage):
    """Padding-free pairs (two rows of one pair and a packed row of three) with each pair's
    prompt computed once for its chosen and rejected sequences (keel.data.shared_prompt):
    the same loss, statistics and gradients as the sequences laid end to end (dpo: its
    reference, the adapters off, on the shared layout too), on a shorter row; the segments
    read as plain samples (not seeing the prompt) move the loss: the negative control."""
    from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
    from keel.train.objective import use_attention

    policy = lora(model, perturb=True)
    register_varlen_attention()
    use_attention(policy, VARLEN_ATTENTION)
    built = objective(policy, stage)
    assert built.shares_pair_prompts
    rows = [*pair_rows()[:2], packed_row()]
    plain = collate(rows, 0, padding_free=True)
    shared = collate(rows, 0, padding_free=True, share_pairs=True)
    prompts = [*PROMPTS[:2], *PROMPTS]
    saved = sum(len(prompt) - 1 for prompt in prompts)  # each pair's prompt but its last token
    assert shared["input_ids"].shape[1] == plain["input_ids"].shape[1] - saved
    assert torch.equal(shared["labels"], plain["labels"])

    results = []
    for batch in (plain, shared):
        policy.zero_grad()
        out = built(batch)
        out.loss.backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    assert got.count.item() == want.count.item() == 5
    assert got.statistics.tolist() == pytest.approx(want.statistics.tolist(), rel=1e-5, abs=1e-6)
    for g, e in zip(got_grads, want_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        leaky = built({**shared, "prefix_groups": None})
    assert abs(leaky.loss.item() - want.loss.item()) > 1e-4 * abs(want.loss.item())  # 10x rel


def test_only_pair_stages_share_prompts(model):
    """KTO's rows are single sequences (no pair to share a prompt), a vision-language model's
    sequences carry images and 3-D positions: neither shares."""
    assert not objective(lora(model), "kto").shares_pair_prompts
    record = get_stage("dpo")
    vision = object()  # a vision-language family: its images and 3-D positions stay whole
    built = PreferenceObjective(model, stage=record, settings=record.settings(), vision=vision)
    assert not built.shares_pair_prompts
