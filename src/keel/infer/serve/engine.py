"""Continuous batching: one scheduler thread owns the model; requests join at the next step.

Each round of the scheduler (`Engine.step`):
1. runs queued calls that change the model (loading/unloading adapters) between steps;
2. drops sequences whose client went away;
3. admits waiting requests while the batch has room and prefills them in one forward
   pass (left-padded, each prompt with its own positions and a mask that hides the
   padding); each samples its first token, and their caches join the running batch
   (`PaddedBatch`, left padding too);
4. runs one decode step for every running sequence at once: one token per row, with the
   row's own position ids and a mask that hides the padding, each row with its adapter.
Finished sequences leave the batch after the step that finished them. Results go to each
job's `sink` from this thread; the sink must not block.
"""

from __future__ import annotations

import sys
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from keel.infer.generate import stop_token_ids  # the same stop tokens as `keel chat`
from keel.infer.serve.adapters import AdapterSet
from keel.infer.serve.kv import PaddedBatch
from keel.infer.serve.sampling import make_generator, pick_tokens
from keel.infer.serve.scheduler import Delta, Done, Failed, Job, SchedulerThread
from keel.infer.serve.text import TextTracker

# Padded prompt tokens prefilled per scheduler round (at least one request): a burst of
# long prompts must not stall the sequences already decoding for long.
PREFILL_TOKENS_PER_STEP = 2048


@dataclass(eq=False)
class _Sequence:
    job: Job
    index: int
    adapter: str  # PEFT adapter name, or "__base__"
    generator: torch.Generator | None
    text: TextTracker
    length: int  # tokens in the cache; the position of `next_token`
    next_token: int = -1  # sampled, not yet fed to the model
    generated: int = 0
    done: bool = False


class Engine(SchedulerThread):
    """Runs generation jobs with continuous batching over `adapters.model`."""

    def __init__(self, adapters: AdapterSet, tokenizer, *, max_batch_size: int):
        super().__init__(name="keel-scheduler")
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        model = adapters.model
        self.device = next(model.parameters()).device
        self.eos_ids = set(stop_token_ids(model, tokenizer))
        self.context_length = context_length(model.config)
        self._waiting: deque[Job] = deque()
        self._running: list[_Sequence] = []  # row i of self._batch is self._running[i]
        self._batch = PaddedBatch()

    def load_adapter(self, name: str, path: str) -> Future:
        return self.call(lambda: self.adapters.load(name, path))

    def unload_adapter(self, name: str) -> Future:
        def unload() -> None:
            self.adapters.unload(name)  # raises first if `name` is not a loaded adapter
            users = [s for s in self._running if s.job.model == name]
            self._fail(users, f"adapter {name!r} was unloaded while this request ran")

        return self.call(unload)

    def _busy(self) -> bool:
        return bool(self._running or self._waiting)

    def _shutdown(self, message: str) -> None:
        self._fail(self._running, message)
        for job in self._waiting:
            job.sink(Failed(message))

    def step(self) -> bool:
        """One scheduler round (see the module docstring); True while work remains."""
        self._waiting.extend(self._take())
        self._fail([s for s in self._running if s.job.cancelled], None)
        with torch.inference_mode():
            self._admit()
            self._retire()  # replies that ended at their first token
            if self._running:
                self._decode()
                self._retire()
        self.stats.running, self.stats.waiting = len(self._running), len(self._waiting)
        return self._busy()

    def _admit(self) -> None:
        """Prefill, together, the waiting jobs that fit: seats in the batch, and at most
        PREFILL_TOKENS_PER_STEP padded prompt tokens (one long prompt goes alone)."""
        group: list[tuple[Job, str]] = []  # (job, PEFT adapter name)
        seats, width = len(self._running), 0
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            longest = max(width, len(job.prompt_ids))
            if group and longest * (len(group) + 1) > PREFILL_TOKENS_PER_STEP:
                break
            if seats and seats + job.n > self.max_batch_size:
                break  # first come, first served: later jobs wait behind this one
            self._waiting.popleft()
            try:
                group.append((job, self.adapters.key(job.model)))
            except KeyError:
                job.sink(Failed(f"model {job.model!r} is no longer served"))
                continue
            seats, width = seats + job.n, longest
        if not group:
            return
        try:
            self._prefill(group, width)
        except Exception as e:  # a failed prefill fails its jobs, not the server
            traceback.print_exc(file=sys.stderr)
            for job, _ in group:
                job.sink(Failed(f"generation failed: {type(e).__name__}: {e}"))

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
        # n choices of one prompt share its prefill: its row is repeated n times.
        rows = [row for row, (job, _) in enumerate(group) for _ in range(job.n)]
        sequences = [
            _Sequence(
                job,
                job.first_index + choice,
                adapter,
                make_generator(job.params, choice),
                TextTracker(self.tokenizer, job.params.stop),
                length=len(job.prompt_ids),
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
        positions = torch.tensor([[s.length] for s in rows], device=self.device)  # [B, 1]
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
            self._fail(rows, f"generation failed: {type(e).__name__}: {e}")
            return
        self._batch.stepped()
        for s in rows:
            s.length += 1
        self.stats.steps += 1
        self._advance(rows, logits)

    def _forward(self, ids: torch.Tensor, cache: DynamicCache, adapters: list[str], **inputs):
        if self.adapters.mixed:
            inputs["adapter_names"] = adapters
        out = self.adapters.model(
            input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **inputs
        )
        return out.logits[:, -1, :]  # [B, V]

    def _advance(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample each sequence's next token, send its text, and mark finished ones."""
        tokens = pick_tokens(
            logits, [s.job.params for s in sequences], [s.generator for s in sequences]
        )
        self.stats.generated_tokens += len(tokens)
        for s, token in zip(sequences, tokens):
            s.generated += 1
            s.next_token = token
            reason = None
            if token in self.eos_ids:
                piece, reason = s.text.flush(), "stop"
            else:
                piece, hit_stop = s.text.add(token)
                if hit_stop:
                    reason = "stop"
                elif s.generated >= s.job.params.max_tokens or s.length >= self.context_length:
                    piece, reason = piece + s.text.flush(), "length"
            if piece:
                s.job.sink(Delta(s.index, piece))
            if reason is not None:
                s.done = True
                s.job.sink(Done(s.index, reason, s.generated))

    def _fail(self, sequences: list[_Sequence], message: str | None) -> None:
        """End `sequences` now; tell their jobs why unless `message` is None (client gone)."""
        jobs = {id(s.job): s.job for s in sequences}.values()
        for job in jobs:
            job.cancelled = True  # its other choices go too
            if message is not None:
                job.sink(Failed(message))
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
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048  # configs without a position limit (e.g. ALiBi models): a safe default
