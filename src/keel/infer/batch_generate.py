"""Completions for training rollouts: keel's continuous-batching engine (the one behind
`keel serve`), driven synchronously on the caller's thread.

A request is one prompt completed `n` times. Completion j samples with its own generator
seeded `seed + j` (serve's rule for n choices), so its tokens are a function of the prompt,
the seed, j and the model's logits: not of the process that generates it. Logits are not
batch-invariant in their last bits (CPU matmuls block by batch size), so a caller that needs
the same tokens in two layouts (2 processes == 1) generates the same requests together in
both: keel.train.rollouts generates in fixed units of prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from keel.infer.serve.adapters import AdapterSet
from keel.infer.serve.engine import Engine
from keel.infer.serve.sampling import SamplingParams
from keel.infer.serve.scheduler import Done, Event, Failed, Job

POLICY = "policy"  # the one served name: the model as it is, its active adapter included


@dataclass(frozen=True, kw_only=True)
class GroupRequest:
    """One prompt to complete `n` times; completion j samples with seed `seed + j`."""

    prompt_ids: list[int]
    n: int
    seed: int
    # a prompt with images: its keel.infer.vision.ImagePrompt (prefilled alone); None: text
    images: object | None = None


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How every completion of a call chooses its tokens."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    banned: tuple[int, ...] = ()  # token ids never chosen (a vision model's image tokens)


@dataclass
class Completion:
    token_ids: list[int]  # includes the stop token when finish_reason == "stop"
    finish_reason: Literal["stop", "length"]


def generate_groups(
    model,
    tokenizer,
    requests: list[GroupRequest],
    sampling: Sampling,
    *,
    max_batch_size: int,
    on_round: Callable[[], None] | None = None,
) -> list[list[Completion]]:
    """result[i][j]: completion j of requests[i], from `model` (a Hugging Face causal LM, or
    a PEFT model with its active adapter) in the mode the caller set (eval to generate).

    Runs the engine `keel serve` runs, at most `max_batch_size` sequences at a time, under
    torch.no_grad (not inference_mode: a sharded policy's gathered weights must stay usable
    by autograd afterwards). `on_round` is called after every engine round (the watchdog's
    progress mark: slow generation is progress). An error in generation is raised again as
    it was (an out-of-memory error stays one).
    """
    adapters = AdapterSet(model, POLICY, per_row=False)
    engine = Engine(
        adapters,
        tokenizer,
        max_batch_size=max_batch_size,
        inference_mode=False,
        stream_text=False,
    )
    results: list[list[Completion | None]] = [[None] * request.n for request in requests]
    failures: list[Failed] = []
    for request, slots in zip(requests, results):
        engine.submit(
            Job(
                prompt_ids=list(request.prompt_ids),
                params=_params(sampling, request.seed),
                model=POLICY,
                sink=_collector(slots, failures),
                n=request.n,
                images=request.images,
            )
        )
    busy = True
    while busy:
        busy = engine.step()
        if failures:
            _raise(failures[0])
        if on_round is not None:
            on_round()
    assert all(c is not None for slots in results for c in slots), "a completion never ended"
    return results  # type: ignore[return-value]


def _params(sampling: Sampling, seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        banned=sampling.banned,
    )


def _collector(slots: list[Completion | None], failures: list[Failed]):
    """The sink of one request's job: each Done fills its completion's slot."""

    def sink(event: Event) -> None:
        if isinstance(event, Done):
            slots[event.index] = Completion(list(event.token_ids), event.reason)
        elif isinstance(event, Failed):
            failures.append(event)

    return sink


def _raise(failure: Failed) -> None:
    if failure.error is not None:
        raise failure.error
    raise RuntimeError(failure.message)  # the engine fails jobs without an error only on shutdown
