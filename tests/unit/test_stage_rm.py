"""train.stage rm: the reward model's objective (scores at each sequence's last token,
Bradley-Terry on chosen vs rejected), its seeded trainable head, its margin column, and
parity with TRL 1.16's RewardTrainer.compute_loss on the same pre-tokenised pairs."""

from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import collate, prepare_data
from keel.models.materialize import allocate
from keel.stages.registry import get_stage
from keel.stages.rm import RmSettings
from keel.train.reward_objective import RewardObjective, head_initial_value
from tests.conftest import build_tiny_model

PAD = 0
# Pre-tokenised pairs: a shared prompt, then each answer ending with its EOS (id 2); the
# answer's tokens are the targets. Ragged lengths, so scores are read at different places.
PAIRS = [
    ([5, 6, 7], [8, 9, 2], [10, 2]),
    ([11, 12], [13, 14, 15, 2], [16, 17, 2]),
    ([18, 19, 20, 21], [22, 2], [23, 24, 25, 2]),
]


def pair_row(prompt: list[int], chosen: list[int], rejected: list[int], margin=None) -> dict:
    """A prepared pair row as keel.data lays it: chosen then rejected, targets pre-shifted."""
    ids, targets, positions = [], [], []
    for answer in (chosen, rejected):
        seq = prompt + answer
        mask = [False] * len(prompt) + [True] * len(answer)
        ids += seq
        targets += [seq[i + 1] if mask[i + 1] else -100 for i in range(len(seq) - 1)] + [-100]
        positions += list(range(len(seq)))
    row = {
        "input_ids": ids,
        "targets": targets,
        "position_ids": positions,
        "labels": [1, 0],
        "num_targets": 1,
    }
    if margin is not None:
        row["margin"] = [margin]
    return row


def objective_for(model, *, seed: int = 0, center: float = 0.0) -> RewardObjective:
    return RewardObjective(
        model,
        stage=get_stage("rm"),
        settings=RmSettings(center_rewards_coefficient=center),
        seed=seed,
    )


def hand_scores(model, head: torch.Tensor, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence run alone, scored at its last token (the answer's EOS)."""
    out = []
    for prompt, *answers in pairs:
        for answer in answers:
            ids = torch.tensor([prompt + answer])
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]  # [H]
            out.append(hidden @ head[0])
    scores = torch.stack(out)
    return scores[0::2], scores[1::2]


def test_loss_accuracy_margin_by_hand():
    model = build_tiny_model(vocab_size=64, seed=1)
    objective = objective_for(model, center=0.01)
    margins = [0.5, 0.0, -0.25]
    rows = [pair_row(*p, margin=m) for p, m in zip(PAIRS, margins)]
    out = objective(collate(rows, PAD))
    chosen, rejected = hand_scores(model, objective.score.weight, PAIRS)
    margin = torch.tensor(margins)
    want = -F.logsigmoid(chosen - rejected - margin) + 0.01 * (chosen + rejected) ** 2
    torch.testing.assert_close(out.loss, want.sum(), rtol=1e-5, atol=1e-6)
    assert out.count.item() == 3
    stats = dict(zip(objective.metric_names, out.statistics.view(-1, 2).tolist()))
    gap = (chosen - rejected).detach()
    assert stats["accuracy"] == [pytest.approx((gap > 0).sum().item()), 3]
    assert stats["margin"][0] == pytest.approx(gap.sum().item(), abs=1e-5)
    assert stats["chosen_reward"][0] == pytest.approx(chosen.sum().item(), abs=1e-5)
    assert stats["rejected_reward"][0] == pytest.approx(rejected.sum().item(), abs=1e-5)
    both = chosen.sum().item() + rejected.sum().item()
    assert stats["mean_reward"] == [pytest.approx(both, abs=1e-5), 6]


def test_packed_and_padding_free_rows_score_the_same():
    """Two pairs in one row (packing) and all rows laid end to end give the same loss."""
    model = build_tiny_model(vocab_size=64, seed=1)
    objective = objective_for(model)
    rows = [pair_row(*p) for p in PAIRS]
    padded = objective(collate(rows, PAD)).loss
    packed = dict(rows[0])
    for key in ("input_ids", "targets", "position_ids", "labels"):
        packed[key] = rows[0][key] + rows[1][key]
    two_rows = objective(collate([packed, rows[2]], PAD)).loss
    torch.testing.assert_close(two_rows, padded, rtol=1e-5, atol=1e-6)


def test_pairs_sharing_their_prompt_score_as_their_sequences_apart():
    """Padding-free, each pair's prompt once (keel.data.shared_prompt): the scores are read at
    the same tokens (each answer's last), so the loss and statistics equal the sequences laid
    end to end; `sequence_ends` (context parallelism's, from the layout's lengths) finds
    those tokens in both layouts."""
    from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
    from keel.train.objective import use_attention
    from keel.train.reward_objective import last_positions, sequence_ends

    model = build_tiny_model(vocab_size=64, seed=1)
    register_varlen_attention()
    use_attention(model, VARLEN_ATTENTION)
    objective = objective_for(model)
    assert objective.shares_pair_prompts
    rows = [pair_row(*p) for p in PAIRS]
    plain = collate(rows, PAD, padding_free=True)
    shared = collate(rows, PAD, padding_free=True, share_pairs=True)
    assert shared["input_ids"].shape[1] < plain["input_ids"].shape[1]
    for batch in (plain, shared):
        assert sequence_ends(batch) == last_positions(batch).tolist()
    want, got = objective(plain), objective(shared)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.statistics, want.statistics, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("center,with_margin", [(None, False), (None, True), (0.01, False)])
def test_step_one_matches_trl_reward_trainer(center, with_margin):
    """TRL's compute_loss on a LlamaForSequenceClassification holding the same backbone and
    head, fed the same pre-tokenised pairs right-padded (pad 0 != EOS 2, so it reads each
    sequence at its EOS): loss, accuracy and margin equal keel's step-1 numbers."""
    from transformers import LlamaForSequenceClassification
    from trl import RewardTrainer

    model = build_tiny_model(vocab_size=64, seed=1)
    objective = objective_for(model, seed=7, center=center or 0.0)
    margins = [0.5, 0.0, 1.0]
    rows = [pair_row(*p, margin=m if with_margin else None) for p, m in zip(PAIRS, margins)]
    out = objective(collate(rows, PAD))
    keel_loss = (out.loss / out.count).item()
    stats = {n: s / c for n, (s, c) in zip(objective.metric_names, out.statistics.view(-1, 2))}

    config = model.config.to_dict() | {"num_labels": 1}
    classifier = LlamaForSequenceClassification(type(model.config)(**config))
    classifier.model.load_state_dict(model.model.state_dict())
    classifier.score.weight.data.copy_(objective.score.weight.data)
    sequences = [p + c for p, c, _ in PAIRS] + [p + r for p, _, r in PAIRS]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    inputs = {"input_ids": ids, "attention_mask": (ids != PAD).long()}
    if with_margin:
        inputs["margin"] = torch.tensor(margins)
    stub = types.SimpleNamespace(
        model=classifier,
        args=types.SimpleNamespace(center_rewards_coefficient=center),
        accelerator=types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x),
        _total_train_tokens=0,
        _tp_size=1,
        _metrics={"train": defaultdict(list)},
    )
    trl_loss = RewardTrainer.compute_loss(stub, classifier, inputs).item()
    assert keel_loss == pytest.approx(trl_loss, rel=1e-6, abs=1e-7)
    metrics = stub._metrics["train"]
    assert stats["accuracy"].item() == pytest.approx(metrics["accuracy"][-1])
    assert stats["margin"].item() == pytest.approx(metrics["margin"][-1], abs=1e-6)


def test_the_head_starts_from_the_seed_on_any_device():
    """Built on a real model or on the meta device and then allocated (as set-up does, before
    loading), the head holds the same seeded value; another seed gives another head."""
    torch.manual_seed(123)  # the global generator plays no part
    real = objective_for(build_tiny_model(vocab_size=64), seed=3).score.weight
    with torch.device("meta"):
        meta_model = build_tiny_model(vocab_size=64)
    objective = objective_for(meta_model, seed=3)
    assert objective.score.weight.device.type == "meta"
    allocate(objective, torch.device("cpu"))
    objective.init_new_weights(region_of=lambda _t: None, local=lambda t: t)
    assert torch.equal(objective.score.weight, real)
    assert not torch.equal(objective_for(build_tiny_model(64), seed=4).score.weight, real)
    # a shard is its region of the same full value
    part = torch.empty(1, 16)
    objective.init_new_weights(
        region_of=lambda _t: (slice(0, 1), slice(16, 32)), local=lambda _t: part
    )
    assert torch.equal(part, head_initial_value(real.shape, 0.02, 3)[:, 16:])
    assert real.std().item() == pytest.approx(0.02, rel=0.5)  # initializer_range


def test_with_lora_the_head_trains_and_the_base_does_not():
    model = build_tiny_model(vocab_size=64, seed=1)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    objective = objective_for(get_peft_model(model, lora))
    trainable = {n for n, p in objective.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable
    assert all("lora_" in n for n in trainable - {"score.weight"})
    before = objective.score.weight.detach().clone()
    optimizer = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=1.0)
    objective(collate([pair_row(*p) for p in PAIRS], PAD)).loss.backward()
    optimizer.step()
    assert not torch.equal(objective.score.weight, before)
    assert "score.weight" in objective.state_dict()  # so the checkpoint holds it


def test_an_untied_output_layer_is_frozen():
    """It never runs: training it would leave DDP waiting for a gradient that never comes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    objective_for(model)
    assert not model.lm_head.weight.requires_grad
    assert model.model.embed_tokens.weight.requires_grad


def test_the_margin_column_reaches_the_rows_of_rm_only(tiny_tokenizer, tmp_path):
    rows = [
        {"prompt": "Say 1.", "chosen": "1.", "rejected": "No.", "margin": 0.75},
        {"prompt": "Say 2.", "chosen": "2.", "rejected": "No.", "margin": 2},
        {"prompt": "Say 3.", "chosen": "3.", "rejected": "No.", "margin": "big"},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def prepared(stage: str, packing: bool = False):
        cfg = DataConfig(
            datasets=[DatasetConfig(path="d.jsonl", format="preference")],
            cutoff_len=64,
            packing=packing,
            on_invalid="skip",
        )
        data = prepare_data(
            cfg,
            tiny_tokenizer,
            stage=stage,
            cache_dir=tmp_path / f"cache-{stage}-{packing}",
            base_dir=tmp_path,
            seed=0,
            log=lambda _line: None,
        )
        return [data.train[i] for i in range(len(data.train))]

    rm_rows = prepared("rm")
    assert sorted(m for r in rm_rows for m in r["margin"]) == [0.75, 2.0]  # "big": rejected
    batch = collate(rm_rows, tiny_tokenizer.pad_token_id)
    assert batch["margin"].shape == (len(rm_rows),)
    packed = prepared("rm", packing=True)
    assert sorted(m for r in packed for m in r["margin"]) == [0.75, 2.0]
    assert all(len(r["margin"]) == len(r["labels"]) // 2 for r in packed)
    assert all("margin" not in r for r in prepared("dpo"))
