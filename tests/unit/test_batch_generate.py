"""Rollout generation: keel's serve engine driven synchronously (keel.infer.batch_generate)."""

from __future__ import annotations

import copy

import pytest
import torch
from serve_support import varied_tiny_model

from keel.infer.batch_generate import Completion, GroupRequest, Sampling, generate_groups

PROMPTS = ["Who are you?", "0 1 2", "Give three tips for staying healthy."]


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return varied_tiny_model(len(tiny_tokenizer))


def requests_for(tokenizer, prompts, *, n=1, seed=0) -> list[GroupRequest]:
    return [
        GroupRequest(prompt_ids=tokenizer.encode(p), n=n, seed=seed + 100 * i)
        for i, p in enumerate(prompts)
    ]


def hf_greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])  # [1, P]
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def test_sampling_is_a_function_of_prompt_seed_and_sample(model, tiny_tokenizer):
    sampling = Sampling(max_tokens=12, temperature=1.0)
    requests = requests_for(tiny_tokenizer, PROMPTS, n=4, seed=7)
    first = generate_groups(model, tiny_tokenizer, requests, sampling, max_batch_size=12)
    again = generate_groups(model, tiny_tokenizer, requests, sampling, max_batch_size=12)
    assert first == again
    assert [len(group) for group in first] == [4, 4, 4]
    # completion j of a prompt samples with seed + j: the group's completions differ ...
    for group in first:
        assert len({tuple(c.token_ids) for c in group}) > 1
    # ... and another seed gives other completions
    other = requests_for(tiny_tokenizer, PROMPTS, n=4, seed=8)
    assert generate_groups(model, tiny_tokenizer, other, sampling, max_batch_size=12) != first


def test_greedy_equals_transformers_generate(model, tiny_tokenizer):
    sampling = Sampling(max_tokens=10, temperature=0.0)
    requests = requests_for(tiny_tokenizer, PROMPTS, n=2)
    # max_batch_size 3: later prompts join while earlier ones decode (continuous batching)
    groups = generate_groups(model, tiny_tokenizer, requests, sampling, max_batch_size=3)
    for prompt, group in zip(PROMPTS, groups):
        expected = hf_greedy(model, tiny_tokenizer, prompt, 10)
        assert [c.token_ids for c in group] == [expected, expected]


def test_stop_token_is_included_and_length_ends_the_rest(model, tiny_tokenizer):
    sampling = Sampling(max_tokens=8, temperature=0.0)
    request = requests_for(tiny_tokenizer, PROMPTS[:1])
    [[free]] = generate_groups(model, tiny_tokenizer, request, sampling, max_batch_size=1)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    # Make the 4th greedy token a stop token: the completion ends there, with it.
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = [free.token_ids[3]]
    [[stopped]] = generate_groups(stopping, tiny_tokenizer, request, sampling, max_batch_size=1)
    first_stop = free.token_ids.index(free.token_ids[3])
    assert stopped == Completion(free.token_ids[: first_stop + 1], "stop")


def test_on_round_marks_every_engine_round(model, tiny_tokenizer):
    rounds = []
    sampling = Sampling(max_tokens=6, temperature=0.0)
    requests = requests_for(tiny_tokenizer, PROMPTS[:1])
    generate_groups(
        model,
        tiny_tokenizer,
        requests,
        sampling,
        max_batch_size=1,
        on_round=lambda: rounds.append(1),
    )
    # round 1 prefills (sampling token 1) and decodes (token 2); each later round decodes one
    assert len(rounds) == 5


def test_runs_under_no_grad_not_inference_mode(model, tiny_tokenizer):
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda *_: seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    )
    try:
        sampling = Sampling(max_tokens=3, temperature=0.0)
        generate_groups(
            model,
            tiny_tokenizer,
            requests_for(tiny_tokenizer, PROMPTS[:1]),
            sampling,
            max_batch_size=1,
        )
    finally:
        hook.remove()
    assert seen and set(seen) == {(False, False)}


def test_a_peft_policy_generates_with_its_active_adapter(model, tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    policy = get_peft_model(copy.deepcopy(model), config).eval()
    sampling = Sampling(max_tokens=10, temperature=0.0)
    groups = generate_groups(
        policy, tiny_tokenizer, requests_for(tiny_tokenizer, PROMPTS), sampling, max_batch_size=3
    )
    for prompt, [completion] in zip(PROMPTS, groups):
        assert completion.token_ids == hf_greedy(policy, tiny_tokenizer, prompt, 10)
    base = generate_groups(
        model, tiny_tokenizer, requests_for(tiny_tokenizer, PROMPTS), sampling, max_batch_size=3
    )
    assert groups != base  # the adapter took part


def test_an_error_in_generation_is_raised_as_it_was(model, tiny_tokenizer):
    def out_of_memory(*_):
        raise torch.OutOfMemoryError("injected")

    hook = model.model.register_forward_pre_hook(out_of_memory)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            sampling = Sampling(max_tokens=3)
            generate_groups(
                model,
                tiny_tokenizer,
                requests_for(tiny_tokenizer, PROMPTS),
                sampling,
                max_batch_size=3,
            )
    finally:
        hook.remove()


def test_generation_ready_evaluates_with_sdpa_and_restores_training(model, tiny_tokenizer):
    from keel.distributed.process_group import DistContext
    from keel.distributed.watchdog import Progress
    from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
    from keel.train.objective import CausalLMObjective, use_attention
    from keel.train.rollout_generation import generation_ready

    policy = copy.deepcopy(model).train()
    register_varlen_attention()
    use_attention(policy, VARLEN_ATTENTION)  # a padding-free training run's attention
    objective = CausalLMObjective(policy)
    with generation_ready(
        objective, dist=DistContext(), progress=Progress(), gather_limit=None
    ) as ready:
        assert ready is policy and not any(m.training for m in ready.modules())
        assert ready.config._attn_implementation == "sdpa"
        sampling = Sampling(max_tokens=6, temperature=0.0)
        [[completion]] = generate_groups(
            ready,
            tiny_tokenizer,
            requests_for(tiny_tokenizer, PROMPTS[:1]),
            sampling,
            max_batch_size=1,
        )
    assert completion.token_ids == hf_greedy(model, tiny_tokenizer, PROMPTS[0], 6)
    assert all(m.training for m in policy.modules())
    assert policy.config._attn_implementation == VARLEN_ATTENTION
