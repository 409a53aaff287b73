"""train.token_weighting: each target token's cross-entropy weighted by a constant factor of
the model's own prediction (dft: its probability; eaft: its normalised top-k entropy), in
training only; whole and chunked heads, right-padded and padding-free batches agree."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from keel.config import load_config
from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
from keel.data import collate
from keel.distributed.process_group import DistContext
from keel.losses import (
    TokenWeighting,
    chunked_weighted_cross_entropy,
    weighted_cross_entropy_sums,
)
from keel.precision import Precision
from keel.train.model_setup import build_training_model
from keel.train.run import run_training

DFT = TokenWeighting("dft")
EAFT = TokenWeighting("eaft", alpha=0.5, top_k=5)


def logits_and_targets(seed: int = 0, n: int = 11, vocab: int = 17):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, vocab, generator=generator)
    targets = torch.randint(vocab, (n,), generator=generator)
    logits[torch.arange(n), targets] += torch.linspace(0, 8, n)  # from unlikely to sure
    targets[[0, 4]] = -100  # prompt positions
    return logits, targets


def reference_weights(logits, targets, weighting: TokenWeighting) -> torch.Tensor:
    """Written from the two papers' formulas, as LLaMA-Factory and Axolotl compute them."""
    keep = targets != -100
    logits, targets = logits[keep], targets[keep]
    if weighting.kind == "dft":
        return torch.softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    top = torch.topk(logits, k=weighting.top_k, dim=-1).values
    probs = F.softmax(top, dim=-1)
    entropy = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)  # Axolotl's, unnormalised
    return (entropy / math.log(weighting.top_k)) ** weighting.alpha


@pytest.mark.parametrize("weighting", [DFT, EAFT], ids=["dft", "eaft"])
def test_each_token_weighs_its_factor_and_no_gradient_flows_through_it(weighting):
    logits, targets = logits_and_targets()
    weights = reference_weights(logits, targets, weighting)
    assert 0 < weights.min() and weights.max() < 1 and weights.std() > 0.05  # varied

    mine = logits.clone().requires_grad_()
    sums = weighted_cross_entropy_sums(mine, targets, weighting)
    keep = targets != -100
    ce = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    torch.testing.assert_close(sums[0], (weights * ce).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(sums[1], ce.sum(), rtol=1e-6, atol=0)
    sums[0].backward()

    # the gradient is each token's cross-entropy gradient times its weight, the weight a
    # constant: softmax - onehot, scaled, on the target positions only
    want = torch.zeros_like(logits)
    probs = torch.softmax(logits[keep], -1)
    want[keep] = weights[:, None] * (probs - F.one_hot(targets[keep], logits.shape[1]))
    torch.testing.assert_close(mine.grad, want, rtol=1e-5, atol=1e-7)
    # negative control: differentiating through the weight gives another gradient
    through = logits.clone().requires_grad_()
    ce_through = F.cross_entropy(through[keep], targets[keep], reduction="none")
    (reference_weights(through, targets, weighting) * ce_through).sum().backward()
    assert (through.grad - mine.grad).abs().max() > 1e-2


@pytest.mark.parametrize("weighting", [DFT, EAFT], ids=["dft", "eaft"])
def test_chunks_sum_to_the_whole(weighting):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 17, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(17, (10,))
    whole = weighted_cross_entropy_sums(head(hidden), targets, weighting)
    grads = torch.autograd.grad(whole[0], [hidden, head.weight])
    chunked = chunked_weighted_cross_entropy(hidden, targets, head, weighting, chunk_size=3)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    for got, want in zip(torch.autograd.grad(chunked[0], [hidden, head.weight]), grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


SAMPLES = [  # (input_ids, pre-shifted targets)
    ([5, 9, 14, 3, 22, 7, 8], [-100, -100, 3, 22, 7, 8, 2]),
    ([5, 11, 6], [-100, 6, 2]),
    ([5, 30, 31, 32, 33], [-100, -100, 32, 33, 2]),
]


def build_objective(model_dir, tmp_path, kind: str, padding_free: bool):
    cfg = RunConfig(
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "out")),
    )
    cfg.train.token_weighting, cfg.train.padding_free = kind, padding_free
    built = build_training_model(cfg, model_dir, DistContext(), Precision("fp32", "test"), print)
    return built.objective


def hugging_face_sums(model_dir, weighting: TokenWeighting) -> torch.Tensor:
    """(weighted, plain) sums from the model's own padded forward with its attention mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = max(len(ids) for ids, _ in SAMPLES)
    ids = torch.zeros(len(SAMPLES), width, dtype=torch.long)
    targets = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (tokens, target) in enumerate(SAMPLES):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        targets[row, : len(tokens)] = torch.tensor(target)
        mask[row, : len(tokens)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return weighted_cross_entropy_sums(logits, targets, weighting)


def keel_output(objective, padding_free: bool):
    rows = [
        {"input_ids": ids, "targets": t, "position_ids": list(range(len(ids)))}
        for ids, t in SAMPLES
    ]
    with torch.no_grad():
        return objective(collate(rows, pad_id=0, padding_free=padding_free))


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_training_weighs_tokens_and_evaluation_does_not(tiny_model_dir, tmp_path, padding_free):
    objective = build_objective(tiny_model_dir, tmp_path, "dft", padding_free)
    assert objective.metric_names == ("ce_loss",)
    want_weighted, want_plain = hugging_face_sums(tiny_model_dir, DFT)
    for fast_head in (True, False):
        objective.fast_head = fast_head
        out = keel_output(objective.train(), padding_free)
        torch.testing.assert_close(out.loss, want_weighted, rtol=1e-5, atol=0)
        torch.testing.assert_close(out.statistics, torch.stack([want_plain, out.count.float()]))
        evaluated = keel_output(objective.eval(), padding_free)
        torch.testing.assert_close(evaluated.loss, want_plain, rtol=1e-5, atol=0)
        assert not evaluated.statistics.any()  # eval logs no ce_loss of its own
    assert want_weighted < 0.5 * want_plain  # a random model's p is small: the weights bite


def test_a_run_logs_ce_loss_beside_the_weighted_loss(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "eaft"
    base = {
        "model": {"path": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
        "method": {"type": "full"},
        "data": {"datasets": [str(data_file)], "val_size": 4},
        "train": {
            "max_steps": 3, "micro_batch_size": 4, "lr": 1e-3, "precision": "fp32",
            "threads": 1, "token_weighting": "eaft", "eaft_top_k": 4, "eval_every": 3,
        },
        "output": {"dir": str(out)},
    }  # fmt: skip
    run_training(load_config(None, [], base=base), log=print)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert len(steps) == 3
    for record in steps:  # weights in (0, 1): the weighted loss is below the plain one
        assert 0 < record["loss"] < record["ce_loss"]
    evals = [r for r in lines if "eval_loss" in r]
    assert evals and "eval_ce_loss" not in evals[-1]


@pytest.mark.parametrize(
    ("train", "problem"),
    [
        (
            {"stage": "dpo", "token_weighting": "dft"},
            "train.token_weighting = dft weights a next-token cross-entropy (stage pt or sft), "
            "not dpo's loss",
        ),
        ({"token_weighting": "eaft", "eaft_top_k": 1}, "train.eaft_top_k = 1 must be at least 2"),
        ({"token_weighting": "eaft", "eaft_alpha": -1.0}, "train.eaft_alpha = -1.0 must be >= 0"),
    ],
)
def test_the_settings_are_checked_before_anything_loads(train, problem, tmp_path):
    from keel.config.validate import check_config

    cfg = RunConfig(
        model=ModelConfig(path=str(tmp_path)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "out")),
    )
    for key, value in train.items():
        setattr(cfg.train, key, value)
    assert any(problem in p for p in check_config(cfg)), check_config(cfg)
