"""Padding-free micro-batches: samples laid end to end, attention kept inside each sample.

The claim is exactness: the same samples per step as right-padded micro-batches, so the
same loss and the same update. Each comparison has a negative control (the varlen
attention without the sample lengths lets samples see each other and moves the loss).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_DECODER

from keel.data import collate
from keel.data.batching import merge_rows
from keel.data.shared_prompt import sample_lengths
from keel.models.attention import SEQ_LENS, VARLEN_ATTENTION, sdpa_varlen
from keel.precision import Precision
from keel.train.loop import Trainer
from keel.train.objective import CausalLMObjective

VOCAB = 96


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        **TINY_DECODER,
        max_position_embeddings=128,
        **{"attn_implementation": "sdpa", **overrides},
    )
    return LlamaForCausalLM(config)


def rows(lengths=(9, 4, 13, 6), packed_second=True) -> list[dict]:
    """Rows of random samples with prompt targets masked; the second row holds two samples."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n + 1,), generator=generator).tolist()
        out.append(
            {
                "input_ids": ids[:-1],
                "targets": [-100, -100, *ids[3:]],
                "position_ids": list(range(n)),
                "num_targets": n - 2,
            }
        )
    if packed_second:
        first, second = out[1], out.pop(2)
        for key in ("input_ids", "targets", "position_ids"):
            first[key] = first[key] + second[key]
        first["num_targets"] += second["num_targets"]
    return out


def test_sample_lengths_and_merge():
    assert sample_lengths([0, 1, 2, 0, 1, 0]) == (3, 2, 1)
    assert sample_lengths([0]) == (1,)
    merged = merge_rows(rows())
    assert len(merged["input_ids"]) == 9 + 4 + 13 + 6
    assert sample_lengths(merged["position_ids"]) == (9, 4, 13, 6)
    assert merged["num_targets"] == 7 + 2 + 11 + 4
    batch = collate(rows(), pad_id=0, padding_free=True)
    assert batch["input_ids"].shape == (1, 32)
    assert batch["seq_lens"] == (9, 4, 13, 6)
    padded = collate(rows(), pad_id=0)
    assert padded["input_ids"].shape == (3, 17) and "seq_lens" not in padded
    # the same tokens and targets, only the padding gone
    keep = padded["targets"] != -100
    assert torch.equal(padded["targets"][keep], batch["targets"][batch["targets"] != -100])


def test_preference_rows_merge_with_their_sequence_numbers():
    pair = {
        "input_ids": [5, 6, 7, 5, 8],
        "targets": [-100, 7, -100, 8, -100],
        "position_ids": [0, 1, 2, 0, 1],
        "num_targets": 1,
        "labels": [1, 0],
    }
    other = {**pair, "labels": [1, 0]}
    batch = collate([pair, other], pad_id=0, padding_free=True)
    padded = collate([pair, other], pad_id=0)
    assert batch["seq_lens"] == (3, 2, 3, 2)
    assert batch["labels"].tolist() == padded["labels"].tolist() == [1, 0, 1, 0]
    assert batch["sequence_index"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 3, 3]]
    assert padded["sequence_index"].tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 3, 3]]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_attention_equals_each_sample_alone(kv_heads):
    lengths = (5, 11, 3)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(lengths), 8, generator=generator, requires_grad=True)
    k = torch.randn(1, kv_heads, sum(lengths), 8, generator=generator, requires_grad=True)
    v = torch.randn(1, kv_heads, sum(lengths), 8, generator=generator, requires_grad=True)

    class Module(torch.nn.Module):
        is_causal = True

    got, _ = sdpa_varlen(Module(), q, k, v, None, scaling=0.3, **{SEQ_LENS: lengths})
    want = []
    for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2)):
        repeat = 4 // kv_heads
        ks, vs = ks.repeat_interleave(repeat, 1), vs.repeat_interleave(repeat, 1)
        want.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3))
    want = torch.cat(want, 2).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad((got * want.detach()).sum(), (q, k, v))
    expected = torch.autograd.grad((want * want.detach()).sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    leaky, _ = sdpa_varlen(Module(), q, k, v, None, scaling=0.3)  # negative control
    assert (leaky - want).abs().amax() > 1e-2


def trainer_for(model, padding_free: bool) -> Trainer:
    objective = CausalLMObjective(model, chunk_size=7)
    ok, why = objective.check_fast_head()
    assert ok, why
    objective.fast_head = True
    if padding_free:
        ok, why = objective.check_varlen_attention()
        assert ok, why
        from keel.models.attention import register_varlen_attention
        from keel.train.objective import use_attention

        register_varlen_attention()
        use_attention(model, VARLEN_ATTENTION)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0),
        precision=Precision("fp32", "test"),
        device=torch.device("cpu"),
        pad_id=0,
        max_grad_norm=0.0,
        padding_free=padding_free,
    )


def test_padding_free_step_equals_padded_step():
    """Two micro-batches of uneven rows (one holding two samples): the same loss and the
    same updated weights padded and padding-free; without the sample lengths the
    padding-free loss moves (negative control)."""
    micro_batches = [rows()[:2], rows()[2:]]
    targets = sum(r["num_targets"] for mb in micro_batches for r in mb)
    tokens = sum(len(r["input_ids"]) for mb in micro_batches for r in mb)
    results = {}
    for padding_free in (False, True):
        model = tiny_llama()
        trainer = trainer_for(model, padding_free)
        result = trainer.train_step(
            micro_batches, window_targets=targets, window_tokens=tokens, filler=rows()[0]
        )
        results[padding_free] = (result.loss_sum, [p.detach().clone() for p in model.parameters()])
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for after_free, after_padded in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(after_free, after_padded, rtol=1e-4, atol=1e-6)

    model = tiny_llama()
    trainer = trainer_for(model, True)
    batch = trainer._batch(micro_batches[0])
    with torch.no_grad():
        exact = trainer.objective(batch).loss
        leaky = trainer.objective({**batch, "seq_lens": None}).loss
    assert abs(float(leaky) - float(exact)) > 1e-3 * abs(float(exact))


def test_sliding_window_applies_within_each_sample():
    """Mistral with a 4-token sliding window over samples of 5 and 7 tokens: keel's varlen
    attention must apply the window (the probe compares with the model's own mask)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        **TINY_DECODER,
        sliding_window=4,
        attn_implementation="sdpa",
    )
    objective = CausalLMObjective(MistralForCausalLM(config))
    ok, why = objective.check_varlen_attention()
    assert ok, why
    objective.model.config.sliding_window = 100  # negative control: the window ignored
    reference = [objective.model(input_ids=torch.arange(3, 10)[None]).logits]
    objective.model.config.sliding_window = 4
    windowed = objective.model(input_ids=torch.arange(3, 10)[None]).logits
    assert (windowed - reference[0]).abs().amax() > 1e-4  # the window matters at 7 tokens


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_sliding_window_is_computed_in_blocks_as_one_mask_gives_it(kv_heads):
    """Samples of 3, 4, 5, 8, 11 and 12 tokens under a 4-token window (shorter than it, a
    whole block, partial blocks): keel's blockwise attention gives the output and gradients
    of one [T, T] mask per sample, query i seeing keys i - 3 .. i."""
    window, lengths = 4, (3, 4, 5, 8, 11, 12)
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, 4, total, 8, generator=generator, requires_grad=True)
    k, v = (
        torch.randn(1, kv_heads, total, 8, generator=generator, requires_grad=True)
        for _ in range(2)
    )
    extra = {SEQ_LENS: lengths, "sliding_window": window}
    got, _ = sdpa_varlen(torch.nn.Module(), q, k, v, None, scaling=0.3, **extra)  # [1, T, H, D]

    def dense(qs, ks, vs):
        i = torch.arange(qs.shape[2])
        seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        ks, vs = (x.repeat_interleave(4 // kv_heads, 1) for x in (ks, vs))
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=0.3)

    pieces = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
    want = torch.cat([dense(*piece) for piece in pieces], 2).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    weights = torch.randn(want.shape, generator=generator)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    # negative control: without the window every query sees its whole sample
    whole, _ = sdpa_varlen(torch.nn.Module(), q, k, v, None, scaling=0.3, **{SEQ_LENS: lengths})
    assert (whole - want).abs().amax() > 1e-2


def test_probe_refuses_attention_that_does_more():
    """StableLM calls torch's sdpa itself (not through transformers' attention interface),
    so the concatenated samples would see each other: the probe says no, the model is
    left as it was and training keeps padded micro-batches. Eager is never switched."""
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(0)
    config = StableLmConfig(
        vocab_size=VOCAB,
        **TINY_DECODER,
        attn_implementation="sdpa",
    )
    objective = CausalLMObjective(StableLmForCausalLM(config))
    ok, why = objective.check_varlen_attention()
    assert not ok and "varlen" in why, why
    assert objective.model.config._attn_implementation == "sdpa"  # left as it was
    eager = CausalLMObjective(tiny_llama(**{"attn_implementation": "eager"}))
    ok, why = eager.check_varlen_attention()
    assert not ok and "eager" in why
    ok, why = CausalLMObjective(tiny_llama()).check_varlen_attention()
    assert ok, why
