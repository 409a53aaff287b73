"""Continuous batching: one scheduler thread owns the model; requests join at the next step.

Each round of the scheduler (`Engine.step`):
1. runs queued calls that change the model (loading/unloading adapters) between steps;
2. drops sequences whose client went away;
3. prefills at most `max_prefill_tokens` prompt tokens: a prompt with images alone and
   whole (its own pixel inputs and positions), or the next chunk of a prompt too
   long for one step (its own cache, a chunk per step), then waiting requests while the
   batch has room, together in one forward pass (left-padded, each prompt with its own
   positions and a mask that hides the padding). A finished prompt samples its first
   token, and its cache joins the running batch (`PaddedBatch`, left padding too);
4. runs one decode step for every running sequence at once: one token per row, with the
   row's own position ids and a mask that hides the padding, each row with its adapter.
Finished sequences leave the batch after the step that finished them. A sequence whose
sampling fails leaves alone, with its job failed; the others go on. Results go to each
job's `sink` from this thread; the sink must not block.

`keel serve` runs the engine on its scheduler thread, under inference_mode, streaming text.
Training rollouts (keel.infer.batch_generate) call `step` on their own thread with
`inference_mode=False` (no_grad: the policy's weights stay usable by autograd) and
`stream_text=False` (only token ids, in `Done`).
"""

from __future__ import annotations

import inspect
import sys
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from keel.infer.generate import stop_token_ids  # the same stop tokens as `keel chat`
from keel.infer.serve.adapters import AdapterSet
from keel.infer.serve.kv import PaddedBatch
from keel.infer.serve.sampling import (
    greedy_tokens,
    make_generator,
    sample_token,
    without_banned,
)
from keel.infer.serve.scheduler import Delta, Done, Failed, Job, SchedulerThread
from keel.infer.serve.text import TextTracker

# Prompt tokens (padding included) prefilled per scheduler round: neither a burst of
# prompts nor one long prompt may stall the sequences already decoding for long.
PREFILL_TOKENS_PER_STEP = 512


@dataclass(eq=False)
class _Sequence:
    job: Job
    index: int
    adapter: str  # PEFT adapter name, or "__base__"
    generator: torch.Generator | None
    text: TextTracker | None  # None: the engine reports token ids only
    length: int  # tokens in the cache; the position of `next_token`
    next_token: int = -1  # sampled, not yet fed to the model
    generated: int = 0
    token_ids: list[int] = field(default_factory=list)  # sampled so far
    done: bool = False
    # M-RoPE (Qwen2-VL) gives an image fewer positions than tokens: the next position is
    # `length + rope_delta` (0 for text and 1-D positions).
    rope_delta: int = 0


@dataclass(eq=False)
class _Chunked:
    """A prompt longer than one round's prefill budget, prefilled a chunk per round."""

    job: Job
    adapter: str
    cache: DynamicCache
    fed: int = 0  # prompt tokens already in `cache`


class Engine(SchedulerThread):
    """Runs generation jobs with continuous batching over `adapters.model`."""

    def __init__(
        self,
        adapters: AdapterSet,
        tokenizer,
        *,
        max_batch_size: int,
        max_prefill_tokens: int = PREFILL_TOKENS_PER_STEP,
        inference_mode: bool = True,
        stream_text: bool = True,
    ):
        super().__init__(name="keel-scheduler")
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        # no_grad instead: FSDP2 allocates a sharded model's unsharded weights on first
        # use, and ones created under inference_mode could never take part in autograd.
        self._grad_mode = torch.inference_mode if inference_mode else torch.no_grad
        self.stream_text = stream_text  # False: no Delta events, stop strings ignored
        model = adapters.model
        self.device = next(model.parameters()).device
        self.eos_ids = set(stop_token_ids(model, tokenizer))
        self.context_length = context_length(model.config)
        self._cache_argument = cache_argument(model)
        self._waiting: deque[Job] = deque()
        self._running: list[_Sequence] = []  # row i of self._batch is self._running[i]
        self._batch = PaddedBatch()
        self._chunked: _Chunked | None = None

    def load_adapter(self, name: str, path: str) -> Future:
        return self.call(lambda: self.adapters.load(name, path))

    def unload_adapter(self, name: str) -> Future:
        def unload() -> None:
            self.adapters.unload(name)  # raises first if `name` is not a loaded adapter
            users = [s.job for s in self._running if s.job.model == name]
            if self._chunked is not None and self._chunked.job.model == name:
                users.append(self._chunked.job)
            self._end_jobs(users, f"adapter {name!r} was unloaded while this request ran")

        return self.call(unload)

    def _busy(self) -> bool:
        return bool(self._running or self._waiting or self._chunked)

    def _shutdown(self, message: str) -> None:
        self._end_jobs([s.job for s in self._running], message)
        if self._chunked is not None:
            self._end_jobs([self._chunked.job], message)
        for job in self._waiting:
            job.sink(Failed(message))

    def step(self) -> bool:
        """One scheduler round (see the module docstring); True while work remains."""
        self._waiting.extend(self._take())
        self._end_jobs([s.job for s in self._running if s.job.cancelled], None)
        with self._grad_mode():
            budget = self.max_prefill_tokens
            budget -= self._prefill_chunk(budget)
            budget -= self._admit(budget)
            self._prefill_chunk(budget)  # a long prompt admitted just now starts at once
            self._retire()  # replies that ended at their first token
            if self._running:
                self._decode()
                self._retire()
        self.stats.running, self.stats.waiting = len(self._running), len(self._waiting)
        return self._busy()

    def _admit(self, budget: int) -> int:
        """Prefill, together, the waiting jobs that fit: seats in the batch, and at most
        `budget` padded prompt tokens. A prompt longer than a whole round's budget is set
        aside to be prefilled in chunks (one at a time). Returns the tokens prefilled."""
        group: list[tuple[Job, str]] = []  # (job, PEFT adapter name)
        seats, width = len(self._running), 0
        if self._chunked is not None:
            seats += self._chunked.job.n
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            if seats and seats + job.n > self.max_batch_size:
                break  # first come, first served: later jobs wait behind this one
            if job.images is not None:
                if group or not self._fits_alone(job, budget):
                    break
                self._waiting.popleft()
                return self._prefill_alone(job)
            chunked = len(job.prompt_ids) > self.max_prefill_tokens
            longest = max(width, len(job.prompt_ids))
            if chunked and (group or self._chunked is not None):
                break
            if not chunked and longest * (len(group) + 1) > budget:
                break
            self._waiting.popleft()
            try:
                adapter = self.adapters.key(job.model)
            except KeyError:
                job.sink(Failed(f"model {job.model!r} is no longer served"))
                continue
            if chunked:
                self._chunked = _Chunked(job, adapter, DynamicCache())
                break
            group.append((job, adapter))
            seats, width = seats + job.n, longest
        if not group:
            return 0
        try:
            self._prefill(group, width)
        except Exception as e:  # a failed prefill fails its jobs, not the server
            traceback.print_exc(file=sys.stderr)
            failed = [job for job, _ in group]
            self._end_jobs(failed, f"generation failed: {type(e).__name__}: {e}", e)
        return width * len(group)

    def _fits_alone(self, job: Job, budget: int) -> bool:
        # A prompt with images is prefilled whole (its image spans must not be cut), alone
        # with its own image inputs; one longer than a round's budget takes a whole round.
        return len(job.prompt_ids) <= budget or budget >= self.max_prefill_tokens

    def _prefill_alone(self, job: Job) -> int:
        """Prefill one prompt with images in its own forward pass (its pixel inputs and
        M-RoPE positions are its own; no padding) and add it to the batch, whose decode
        steps then treat it like any text sequence. Returns the tokens prefilled."""
        prompt = job.images
        try:
            adapter = self.adapters.key(job.model)
        except KeyError:
            job.sink(Failed(f"model {job.model!r} is no longer served"))
            return 0
        ids = torch.tensor([job.prompt_ids], device=self.device)  # [1, P]
        inputs = {key: value.to(self.device) for key, value in prompt.inputs.items()}
        if prompt.rope_positions is not None:
            # Explicit positions: the model never falls back on offsets it cached itself.
            inputs["position_ids"] = prompt.rope_positions[:, None, :].to(self.device)  # [3, 1, P]
        cache = DynamicCache()
        try:
            logits = self._forward(ids, cache, [adapter], **inputs)  # [1, V]
            valid = torch.ones(1, len(job.prompt_ids), dtype=torch.bool, device=self.device)
            self._join([(job, adapter)], cache, valid, logits)
        except Exception as e:  # a failed prefill fails its job, not the server
            traceback.print_exc(file=sys.stderr)
            self._end_jobs([job], f"generation failed: {type(e).__name__}: {e}", e)
        return len(job.prompt_ids)

    def _prefill_chunk(self, budget: int) -> int:
        """Feed the next chunk (at most `budget` tokens) of the prompt being prefilled in
        chunks; its last chunk makes it join the batch. Returns the tokens fed."""
        part = self._chunked
        if part is None or budget <= 0:
            return 0
        if part.job.cancelled:
            self._chunked = None
            return 0
        prompt = part.job.prompt_ids
        chunk = prompt[part.fed : part.fed + budget]
        ids = torch.tensor([chunk], device=self.device)  # [1, C]
        positions = torch.arange(part.fed, part.fed + len(chunk), device=self.device)[None]
        try:
            logits = self._forward(ids, part.cache, [part.adapter], position_ids=positions)
            part.fed += len(chunk)
            if part.fed == len(prompt):
                self._chunked = None
                valid = torch.ones(1, len(prompt), dtype=torch.bool, device=self.device)  # [1, P]
                self._join([(part.job, part.adapter)], part.cache, valid, logits)
        except Exception as e:  # fails this job, not the server
            traceback.print_exc(file=sys.stderr)
            self._chunked = None
            self._end_jobs([part.job], f"generation failed: {type(e).__name__}: {e}", e)
        return len(chunk)

    def _prefill(self, group: list[tuple[Job, str]], width: int) -> None:
        """One forward pass over the group's prompts, left-padded to `width`; each prompt
        gets positions 0..P-1 and never attends to padding."""
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(group), width), pad, dtype=torch.long)  # [G, T]
        valid = torch.zeros(len(group), width, dtype=torch.bool)  # [G, T]
        for row, (job, _) in enumerate(group):
            ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            valid[row, width - len(job.prompt_ids) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        padded = not bool(valid.all())
        cache = DynamicCache()
        logits = self._forward(
            ids,
            cache,
            [adapter for _, adapter in group],
            attention_mask=valid.long() if padded else None,
            position_ids=(valid.long().cumsum(dim=1) - 1).clamp(min=0) if padded else None,
        )  # [G, V]
        self._join(group, cache, valid, logits)

    def _join(self, group, cache: DynamicCache, valid: torch.Tensor, logits: torch.Tensor):
        """Add the prefilled prompts of `group` (rows of `cache`, real columns `valid`
        [G, P], last-token `logits` [G, V]) to the running batch; sample first tokens."""
        # n choices of one prompt share its prefill: its row is repeated n times.
        rows = [row for row, (job, _) in enumerate(group) for _ in range(job.n)]
        sequences = [
            _Sequence(
                job,
                job.first_index + choice,
                adapter,
                make_generator(job.params, choice),
                TextTracker(self.tokenizer, job.params.stop) if self.stream_text else None,
                length=len(job.prompt_ids),
                rope_delta=0 if job.images is None else job.images.rope_delta,
            )
            for job, adapter in group
            for choice in range(job.n)
        ]
        self._batch.add(cache, valid, rows)
        self._running.extend(sequences)
        self.stats.peak_batch = max(self.stats.peak_batch, len(self._running))
        self._advance(sequences, logits[rows])

    def _decode(self) -> None:
        rows = self._running
        ids = torch.tensor([[s.next_token] for s in rows], device=self.device)  # [B, 1]
        positions = [[s.length + s.rope_delta] for s in rows]
        positions = torch.tensor(positions, device=self.device)  # [B, 1]
        try:
            logits = self._forward(
                ids,
                self._batch.cache,
                [s.adapter for s in rows],
                attention_mask=self._batch.step_mask(),  # [B, T + 1]
                position_ids=positions,
            )  # [B, V]
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            message = f"generation failed: {type(e).__name__}: {e}"
            self._end_jobs([s.job for s in rows], message, e)
            return
        self._batch.stepped()
        for s in rows:
            s.length += 1
        self.stats.steps += 1
        self._advance(rows, logits)

    def _forward(self, ids: torch.Tensor, cache: DynamicCache, adapters: list[str], **inputs):
        if self.adapters.mixed:
            inputs["adapter_names"] = adapters
        inputs[self._cache_argument] = cache
        out = self.adapters.model(input_ids=ids, use_cache=True, logits_to_keep=1, **inputs)
        return out.logits[:, -1, :]  # [B, V]

    def _advance(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample each sequence's next token, send its text, and mark finished ones. A
        sequence whose sampling fails ends with its job; the others are not touched."""
        logits = without_banned(logits, [s.job.params for s in sequences])
        greedy = greedy_tokens(logits)  # every row; sampled rows overwrite theirs
        failed: dict[int, tuple[Job, str, Exception]] = {}
        for row, s in enumerate(sequences):
            if s.job.cancelled:
                s.done = True  # never fed to the model again; leaves at the next _retire
            if s.done:
                continue
            try:
                token = greedy[row]
                if s.job.params.temperature > 0:
                    token = sample_token(logits[row], s.job.params, s.generator)
                self._emit(s, token)
            except Exception as e:  # this request's numbers or text, not the batch's
                traceback.print_exc(file=sys.stderr)
                s.done = True
                failed[id(s.job)] = (s.job, f"sampling failed: {type(e).__name__}: {e}", e)
        for job, message, error in failed.values():
            self._end_jobs([job], message, error)

    def _emit(self, s: _Sequence, token: int) -> None:
        """Record `s`'s new token, send its text, and mark it done if it finished."""
        self.stats.generated_tokens += 1
        s.generated += 1
        s.next_token = token
        s.token_ids.append(token)
        if s.text is None:
            piece, reason = "", "stop" if token in self.eos_ids else self._out_of_room(s)
        else:
            piece, reason = self._text_piece(s, token)
        if piece:
            s.job.sink(Delta(s.index, piece))
        if reason is not None:
            s.done = True
            s.job.sink(Done(s.index, reason, s.generated, tuple(s.token_ids)))

    def _text_piece(self, s: _Sequence, token: int) -> tuple[str, str | None]:
        """(`s`'s new text, "stop" / "length" if `token` ends it, else None)."""
        if token in self.eos_ids:
            return s.text.flush(), "stop"
        piece, hit_stop = s.text.add(token)
        if hit_stop:
            return piece, "stop"
        reason = self._out_of_room(s)
        if reason is not None:
            piece += s.text.flush()
        return piece, reason

    def _out_of_room(self, s: _Sequence) -> str | None:
        """ "length" once `s` has its max_tokens or fills the model's context, else None."""
        if s.generated >= s.job.params.max_tokens or s.length >= self.context_length:
            return "length"
        return None

    def _end_jobs(
        self, jobs: list[Job], message: str | None, error: BaseException | None = None
    ) -> None:
        """End `jobs` now, every choice of each; tell them why (and what was raised, if
        anything) unless `message` is None (the client is gone). Their sequences leave
        the batch."""
        for job in {id(job): job for job in jobs}.values():
            job.cancelled = True
            if message is not None:
                job.sink(Failed(message, error))
        for s in self._running:
            if s.job.cancelled:
                s.done = True
        self._retire()

    def _retire(self) -> None:
        keep = [row for row, s in enumerate(self._running) if not s.done]
        if len(keep) < len(self._running):
            self._batch.keep(keep)
            self._running = [self._running[row] for row in keep]


def context_length(config) -> int:
    """The longest sequence (prompt + reply) the model's positions allow."""
    config = config.get_text_config()  # a vision-language model's language model
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048  # configs without a position limit (e.g. ALiBi models): a safe default


def cache_argument(model) -> str:
    """The name under which `model`'s forward takes its KV cache. transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); models that
    predate the rename still take only the old name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
