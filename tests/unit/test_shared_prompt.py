"""A grpo micro-batch with each prompt computed once (keel.data.shared_prompt).

The claim is exactness: every completion token gets the log-prob (and the gradient) it gets
with its prompt in its own row; only the repeated prompt work goes. The attention test has a
negative control (the group's segments laid out as plain samples no longer see the prompt),
and so does the objective test (the segments seeing each other moves the loss).
"""

import pytest
import torch
import torch.nn.functional as F

from keel.data import collate
from keel.data.shared_prompt import sequence_index, share_prompts, unshare
from keel.models.attention import PREFIX_GROUPS, SEQ_LENS, sdpa_varlen

PROMPT_A, PROMPT_B = [5, 17, 40, 9], [7, 81, 33]


def row(prompt: list[int], completion: list[int], advantage: float) -> dict:
    ids = prompt + completion
    targets = [-100] * (len(prompt) - 1) + completion + [-100]
    return {
        "input_ids": ids,
        "targets": targets,
        "position_ids": list(range(len(ids))),
        "prompt_len": len(prompt),
        "num_targets": len(completion),
        "advantages": [advantage],
        "kept": [1.0],
        "old_logps": [0.0] * (len(prompt) - 1) + [-0.5] * len(completion) + [0.0],
    }


ROWS = [
    row(PROMPT_A, [21, 22, 23, 2], 0.7),
    row(PROMPT_A, [44, 2], -0.7),
    row(PROMPT_B, [90, 91, 92], 1.1),
    row(PROMPT_B, [60], -1.1),
]


def test_each_prompt_is_laid_out_once_and_the_values_come_back_per_row():
    merged, groups = share_prompts(ROWS)
    assert groups == ((3, (5, 3)), (2, (4, 2)))
    assert merged["input_ids"] == [5, 17, 40, 9, 21, 22, 23, 2, 9, 44, 2, 7, 81, 33, 90, 91, 92, 33, 60]  # fmt: skip
    assert merged["position_ids"] == [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 0, 1, 2, 3, 4, 5, 2, 3]
    # every target stays next to its input: the token after it in its own row
    assert merged["targets"] == [-100, -100, -100, 21, 22, 23, 2, -100, 44, 2, -100, -100, -100, 90, 91, 92, -100, 60, -100]  # fmt: skip
    assert merged["advantages"] == [0.7, -0.7, 1.1, -1.1] and merged["num_targets"] == 10
    assert sequence_index(groups) == [-1] * 3 + [0] * 5 + [1] * 3 + [-1] * 2 + [2] * 4 + [3] * 2
    assert unshare(merged["old_logps"], ROWS) == [r["old_logps"] for r in ROWS]
    # a prompt that only starts like another is not shared
    other = row([5, 17, 40, 8], [3], 0.0)
    assert [len(s) for _, s in share_prompts([ROWS[0], other])[1]] == [1, 1]


def test_collate_gives_the_groups_and_a_shorter_row():
    batch = collate(ROWS, 0, padding_free=True)
    assert batch["prefix_groups"] == ((3, (5, 3)), (2, (4, 2)))
    assert batch["seq_lens"] == (11, 8)
    assert batch["input_ids"].shape == (1, 19)  # not 24: the rows laid end to end
    assert batch["sequence_index"].tolist() == [sequence_index(batch["prefix_groups"])]
    assert batch["old_logps"].shape == (1, 19)
    assert batch["advantages"].tolist() == pytest.approx([0.7, -0.7, 1.1, -1.1])
    padded = collate(ROWS, 0)
    assert "prefix_groups" not in padded and padded["input_ids"].shape == (4, 8)


class Causal(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize(
    "kv_heads,window,prompt_len",
    [(4, None, 4), (2, None, 4), (4, 3, 4), (2, 3, 9), (4, None, 1)],
)
def test_group_attention_equals_each_sample_alone(kv_heads, window, prompt_len):
    """Per-token q, k, v of a 4-token prompt (a 1-token one: no prefix; a 9-token one under
    a 3-token window: the prefix in blocks) and completions of 3, 1 and 2 tokens: the
    group's output (and gradients) equal each prompt + completion attended alone."""
    generator = torch.Generator().manual_seed(0)
    lengths = (3, 1, 2)

    def tokens(n: int, heads: int) -> torch.Tensor:
        return torch.randn(1, heads, n, 8, generator=generator)

    parts = {
        name: (tokens(prompt_len, h), [tokens(n, h) for n in lengths])
        for name, h in (("q", 4), ("k", kv_heads), ("v", kv_heads))
    }
    leaves = [t.requires_grad_() for p, cs in parts.values() for t in (p, *cs)]

    def grouped(name):
        prompt, completions = parts[name]
        segments = [torch.cat([prompt[:, :, -1:], c], 2) for c in completions]
        return torch.cat([prompt[:, :, :-1], *segments], 2)

    groups = ((prompt_len - 1, tuple(n + 1 for n in lengths)),)
    q, k, v = grouped("q"), grouped("k"), grouped("v")
    extra = {PREFIX_GROUPS: groups, "sliding_window": window}
    got, _ = sdpa_varlen(Causal(), q, k, v, None, scaling=0.3, **extra)  # [1, T, H, D]

    alone = []
    for i in range(len(lengths)):
        qi, ki, vi = (torch.cat([parts[n][0], parts[n][1][i]], 2) for n in "qkv")
        ki, vi = ki.repeat_interleave(4 // kv_heads, 1), vi.repeat_interleave(4 // kv_heads, 1)
        positions = torch.arange(qi.shape[2])
        seen = positions[None, :] <= positions[:, None]
        if window is not None:
            seen &= positions[None, :] > positions[:, None] - window
        alone.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=seen, scale=0.3))
    want = torch.cat(
        [alone[0][:, :, : prompt_len - 1]] + [a[:, :, prompt_len - 1 :] for a in alone], 2
    ).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # gradients: the prompt's reach it through every completion, as rows alone give them
    weights = torch.randn(want.shape, generator=generator)
    grads = torch.autograd.grad((got * weights).sum(), leaves)
    expected = torch.autograd.grad((want * weights).sum(), leaves, allow_unused=True)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    if prompt_len > 1:  # negative control: the segments as plain samples miss the prompt
        samples = {SEQ_LENS: (prompt_len - 1, *groups[0][1])}
        plain, _ = sdpa_varlen(Causal(), q, k, v, None, scaling=0.3, **samples)
        assert (plain - want).abs().amax() > 1e-2
