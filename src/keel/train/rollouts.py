"""Online RL's batch source: each step's rows are completions the current policy samples
for the step's prompts, scored by the reward functions (GRPO and its variants).

A step's prompts are `StepPlan.window` over the prompt rows (the global batch counts
prompts). Each data-parallel rank takes a contiguous block of them, so a prompt's group of
completions never crosses ranks and the group advantages need no communication. Sampling is
seeded per (train.seed, generation step, prompt row, sample), never per rank, and each unit
of `grpo.generation_batch_prompts` prompts is generated on its own: 2 processes sample the
completions 1 process samples. A context-parallel group's processes share a block: each
samples and scores every C-th unit of it, and one gather gives every process of the group
all of them, so the group trains on the same completions (each its part of their tokens),
and generation takes 1/C of the time. A tensor-parallel group's processes generate the
block together, each with its heads (the same seeds and the same all-reduced logits give
each the same completions), and each scores them; its first process counts them. With `grpo.num_iterations` mu > 1 a rollout feeds mu
optimizer steps, its old log-probs taken once, before the first of them; a checkpoint
inside those steps holds each process's rollout, so a resumed run trains the remaining
steps on it, as the uninterrupted run does.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from keel.distributed.context_parallel import gather_parts
from keel.distributed.parallelize import unwrap
from keel.errors import CheckpointError, KeelError
from keel.faults import Fault, after_generation_round
from keel.infer.batch_generate import GroupRequest, Sampling, generate_groups
from keel.losses.grpo import group_advantages, loss_unit
from keel.rewards import RewardLog, TrainerState, score_rewards, weighted_rewards
from keel.train.batch_source import StepBatch, StepPlan
from keel.train.completions_log import CompletionRecord
from keel.train.objective import causal_lm_of
from keel.train.rollout_generation import generation_ready
from keel.train.rollout_metrics import RolloutTally, rollout_metrics
from keel.train.rollout_rewards import logged_metrics, reserved_metrics, reward_inputs
from keel.train.rollout_rows import (
    NO_TARGET,
    ScoredPrompts,
    generation_units,
    image_prompt,
    join_parts,
    per_row,
    rank_block,
    rollout_row,
    sample_seed,
    units_of_part,
    with_prompt_images,
    without_images,
)

if TYPE_CHECKING:
    from datasets import Dataset

    from keel.infer.batch_generate import Completion
    from keel.rewards import RewardFunction
    from keel.stages.grpo import GrpoSettings
    from keel.train.completions_log import CompletionsLog
    from keel.train.loop import Trainer


@dataclass(kw_only=True)
class RolloutContext:
    """What the source generates, scores and logs with (one per process)."""

    trainer: Trainer  # its objective is the policy; its collate, precision and dist are used
    tokenizer: Any
    rewards: list[RewardFunction]
    hang_limit: float | None  # seconds without progress in a reward call or the weight gather
    # what reward functions read from trainer_state besides the step (the run's length,
    # which process this is); keel.rewards.TrainerState
    trainer_state: TrainerState = field(default_factory=lambda: TrainerState(global_step=0))
    completions: CompletionsLog | None = None  # rank 0 only
    fault: Fault | None = None  # KEEL_FAULT's, for its generation kinds (keel.faults)


@dataclass(kw_only=True)
class _Rollout:
    """One generation's rows on this process, ready for mu steps."""

    generation_step: int
    micro_batches: list[list[dict]]
    filler: dict
    window_targets: int
    window_tokens: int
    rows: int
    metrics: dict[str, float]
    samples: list[CompletionRecord] = field(default_factory=list)  # for completions.jsonl


class RolloutBatchSource:
    """Rows of sampled completions for each step, on this data-parallel rank."""

    def __init__(
        self, plan: StepPlan, prompts: Dataset, settings: GrpoSettings, context: RolloutContext
    ):
        self.plan, self.prompts, self.settings, self.ctx = plan, prompts, settings, context
        self.dist = context.trainer.dist
        self._rollout: _Rollout | None = None
        self._next_step = 0  # the step after the last one served (a save's step)
        self._reserved = self._reserved_metrics()  # names log_metric may not take

    @property
    def group(self) -> int:
        return self.settings.num_generations

    def batch(self, step: int) -> StepBatch:
        """Step `step`'s rollout rows: generated at the first step of each num_iterations
        span, reused by the others (after a resume inside a span, the checkpoint's)."""
        mu = self.settings.num_iterations
        generation_step = step - step % mu
        rollout = self._rollout
        fresh = rollout is None or rollout.generation_step != generation_step
        if fresh:
            rollout = self._rollout = self._generate(generation_step, step)
        self._next_step = step + 1
        log = self.ctx.completions
        if log is not None and log.due(step + 1) and rollout.samples:
            log.write([_at_step(record, step + 1) for record in rollout.samples])
        metrics = rollout.metrics if fresh else {**rollout.metrics, "generation_seconds": 0.0}
        return StepBatch(
            micro_batches=rollout.micro_batches,
            window_targets=rollout.window_targets,
            window_tokens=rollout.window_tokens,
            filler=rollout.filler,
            rows=rollout.rows,
            metrics=metrics,
        )

    def epoch_of(self, step: int) -> float:
        return self.plan.epoch_of(step / self.settings.num_iterations)

    def _generate(self, generation_step: int, step: int) -> _Rollout:
        window = self.plan.window(generation_step // self.settings.num_iterations)
        block = rank_block(window, self.dist.dp_rank, self.dist.dp_size)
        units = generation_units(block, self.settings.generation_batch_prompts)
        mine = units_of_part(units, self.dist.cp_rank, self.dist.cp_size)
        scored = self._score(mine, self._sample(mine, generation_step), step)
        if self.dist.tp_size > 1:
            self._check_group_sampled_alike(scored, generation_step)
        logged = logged_metrics(self.dist, scored.logged)  # this process's calls, and others'
        if self.dist.cp_size > 1:  # the group trains on every completion of its block
            scored = self._joined(units, scored)
        if self.settings.scale_rewards == "batch":  # the std of the whole window's rewards
            scored.advantages = self._batch_scaled(scored.rewards, len(window))
        rows = [
            rollout_row(
                self.prompts[scored.prompts[i // self.group]],
                completion.token_ids,
                scored.advantages[i].item(),
                trained=self._trained(completion),
            )
            for i, completion in enumerate(scored.completions)
        ]
        micro = self._micro_batches(rows, len(window))
        filler = rows[0] if rows else self._filler_row(window[0])
        if self.settings.num_iterations > 1:
            self._add_old_logps(micro, filler)
        tally = RolloutTally.of(scored, rows, self.group, self.ctx.rewards)
        if not self.dist.leads_group:  # its group's first process counts the group's block
            tally = RolloutTally.zero(len(self.ctx.rewards))
        totals = tally.all_reduced(self.dist)
        # the loss's unit over the whole window: completions, or (dapo) completion tokens
        completions = len(window) * self.group
        per_token = loss_unit(self.settings.loss_type) == "completion_tokens"
        return _Rollout(
            generation_step=generation_step,
            micro_batches=micro,
            filler=filler,
            window_targets=round(totals.target_tokens) if per_token else completions,
            window_tokens=round(totals.real_tokens),
            rows=completions,
            metrics=rollout_metrics(totals, [f.short for f in self.ctx.rewards]) | logged,
            samples=self._samples(scored) if self.ctx.completions is not None else [],
        )

    def _check_group_sampled_alike(self, scored: ScoredPrompts, generation_step: int) -> None:
        """A tensor-parallel group's processes must sample the same completions (same seeds,
        same all-reduced logits): keel's gather of each process's digest of them, compared
        within the group as `_joined` picks a context-parallel group's parts, so a backend
        whose all-reduce left them a bit apart stops the run, not trains on other rows."""
        ids = json.dumps([list(c.token_ids) for c in scored.completions])
        mine = hashlib.sha256(ids.encode()).hexdigest()  # a digest: the gather is the world's
        dims = self.dist.dims
        group = [
            theirs
            for rank, theirs in enumerate(self.dist.gather_objects(mine))
            if dims.dp_rank(rank) == self.dist.dp_rank
        ]
        if any(theirs != mine for theirs in group):
            raise KeelError(
                f"tensor parallelism: the processes of a group sampled different completions "
                f"at generation step {generation_step} (their all-reduced logits differ in the "
                f"last bits on this backend); use distributed.tensor_parallel 1 for grpo here"
            )

    def _joined(self, units: list[list[int]], scored: ScoredPrompts) -> ScoredPrompts:
        """The whole block's scored completions from the parts its context-parallel group's
        processes generated and scored (`units_of_part`), in block order: one gather of
        every process's part, so the group trains on the same rows whatever each process's
        kernels or reward calls would have given had each sampled them all."""
        dims = self.dist.dims
        parts = {
            dims.cp_rank(rank): part
            for rank, part in enumerate(self.dist.gather_objects(scored))
            if dims.dp_rank(rank) == self.dist.dp_rank
        }
        return join_parts(units, [parts[r] for r in range(len(parts))], self.group)

    def _trained(self, completion: Completion) -> bool:
        return not (
            self.settings.mask_truncated_completions and completion.finish_reason == "length"
        )

    def _sample(self, block: list[int], generation_step: int) -> tuple[list[Completion], float]:
        """G completions per prompt of `block`, generated in units of generation_batch_prompts
        prompts. Every rank enters the weight gather (FSDP2's collectives), even with no
        prompts; generation itself is local."""
        settings, trainer = self.settings, self.ctx.trainer
        sampling = Sampling(
            max_tokens=settings.max_completion_length,
            temperature=settings.temperature,
            top_p=settings.top_p,
            banned=self._image_tokens(),
        )
        unit = settings.generation_batch_prompts
        progress = trainer.progress
        completions: list[Completion] = []
        began = time.perf_counter()
        with generation_ready(
            trainer.objective, dist=self.dist, progress=progress, gather_limit=self.ctx.hang_limit
        ) as model:
            lm = causal_lm_of(model)  # a vision-language model's config: its image inputs
            for prompts in generation_units(block, unit):
                requests = [
                    GroupRequest(
                        prompt_ids=list(self.prompts[row]["input_ids"]),
                        n=self.group,
                        seed=sample_seed(self.plan.seed, generation_step, row),
                        images=image_prompt(self.prompts[row], lm.config),
                    )
                    for row in prompts
                ]
                groups = generate_groups(
                    model,
                    self.ctx.tokenizer,
                    requests,
                    sampling,
                    max_batch_size=len(requests) * self.group,
                    on_round=self._generation_round,
                )
                completions += [c for group in groups for c in group]
        return completions, time.perf_counter() - began

    def _image_tokens(self) -> tuple[int, ...]:
        """A vision-language policy's image token, which a completion must not hold (its
        forward would look for image features for it); () for a text model."""
        vision = unwrap(self.ctx.trainer.objective).vision
        if vision is None:
            return ()
        return (self.ctx.tokenizer.convert_tokens_to_ids(vision.image_token),)

    def _generation_round(self) -> None:
        """After each engine round: progress (slow generation is not a hang), then any
        generation fault due (so a hung rank's last mark names the generation)."""
        progress = self.ctx.trainer.progress
        progress.mark("generation round")
        after_generation_round(self.ctx.fault, progress.step, self.dist.rank)

    def _score(
        self, block: list[int], sampled: tuple[list[Completion], float], step: int
    ) -> ScoredPrompts:
        """Every reward function over this rank's completions (each call a watched phase),
        their weighted sum and the group advantages."""
        completions, seconds = sampled
        texts = [
            self.ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions
        ]
        count = len(self.ctx.rewards)
        if not completions:
            empty = torch.zeros(0)
            return ScoredPrompts(
                prompts=block, completions=[], scores=torch.zeros(0, count), rewards=empty,
                advantages=empty, texts=[], seconds=seconds,
            )  # fmt: skip
        state = replace(self.ctx.trainer_state, global_step=step, epoch=self.epoch_of(step))
        inputs = reward_inputs(
            self.prompts, block, [(c.token_ids, t) for c, t in zip(completions, texts)], state
        )
        log = RewardLog(len(completions), reserved=self._reserved)
        scores = score_rewards(self.ctx.rewards, inputs, watch=self._watch, log=log)
        rewards = weighted_rewards(scores, self.settings.reward_weights)  # [N]
        advantages = group_advantages(rewards, self.group, scale=self.settings.scale_rewards)
        return ScoredPrompts(
            prompts=block, completions=completions, scores=scores, rewards=rewards,
            advantages=advantages, texts=texts, seconds=seconds, extras=log.extras,
            logged=log.metrics,
        )  # fmt: skip

    def _reserved_metrics(self) -> frozenset[str]:
        """The step record's names, which a reward function's log_metric may not take."""
        names = [f.short for f in self.ctx.rewards]
        own = rollout_metrics(RolloutTally.zero(len(names)), names)
        stage = list(self.ctx.trainer.inner_objective.metric_names or ())
        return reserved_metrics(list(own), stage)

    def _batch_scaled(self, rewards: torch.Tensor, window_prompts: int) -> torch.Tensor:
        """This rank's advantages under scale_rewards batch: the std is of every rank's
        rewards, so each rank first gets the window's rewards (one all-reduce in which each
        rank fills its own contiguous block; exact, so 2 processes == 1 bit for bit)."""
        size = window_prompts * self.group
        start = self.dist.dp_rank * math.ceil(window_prompts / self.dist.dp_size) * self.group
        values, unscorable = [0.0] * size, [0.0] * size
        # a context- or tensor-parallel group's processes hold the same block: its first
        # one sends it
        for i, reward in enumerate(rewards.tolist() if self.dist.leads_group else []):
            if math.isnan(reward):
                unscorable[start + i] = 1.0
            else:
                values[start + i] = reward
        total = self.dist.all_reduce_sum(values + unscorable)
        window = torch.tensor(total[:size], dtype=torch.float32)
        window[torch.tensor(total[size:]) > 0] = float("nan")
        advantages = group_advantages(window, self.group, scale="batch")
        return advantages[start : start + rewards.numel()]

    def _watch(self, name: str):
        return self.ctx.trainer.progress.phase(name, self.ctx.hang_limit)

    def _micro_batches(self, rows: list[dict], window_prompts: int) -> list[list[dict]]:
        """micro_batch_size prompts (x G completions) each; the same count on every rank,
        padded with [] (zero-weight filler)."""
        per_rank = math.ceil(window_prompts / self.dist.dp_size)
        count = max(1, math.ceil(per_rank / self.plan.micro_batch_size))
        size = self.plan.micro_batch_size * self.group
        return [rows[i * size : (i + 1) * size] for i in range(count)]

    def _filler_row(self, row: int) -> dict:
        """A real row for a rank without prompts in this window (weight zero in the step)."""
        prompt = self.prompts[row]
        eos = self.ctx.tokenizer.eos_token_id
        token = eos if eos is not None else prompt["input_ids"][-1]
        return rollout_row(prompt, [token], 0.0, trained=True)

    def _add_old_logps(self, micro_batches: list[list[dict]], filler: dict) -> None:
        """Each row's per-token log-probs under the weights that sampled it (num_iterations >
        1): one no-grad forward per micro-batch, a filler one too (FSDP2: every rank runs the
        same forwards)."""
        trainer = self.ctx.trainer
        trainer.objective.train()  # as the step that first trains on them runs
        with torch.no_grad():
            for index, rows in enumerate(micro_batches):
                trainer.progress.mark(("micro-batch", index, "old log-probs"))
                batch = trainer._batch(rows or [filler])
                with trainer.precision.autocast(trainer.device):
                    flat = trainer.objective(batch, mode="token_logps")  # [N] target tokens
                mask = batch["targets"] != NO_TARGET  # [B, T]
                logps = torch.zeros(mask.shape, dtype=torch.float32, device=flat.device)
                logps[mask] = flat.float()
                if self.dist.cp_size > 1:  # this process's part of the row: the group's
                    logps = gather_parts(logps, self.dist.cp_group)  # whole (padded) row
                for row, values in zip(rows, per_row(logps, rows, trainer.padding_free)):
                    row["old_logps"] = values
        # a filler of its own (this rank had no prompts) trains with weight zero: any values
        filler.setdefault("old_logps", [0.0] * len(filler["input_ids"]))

    def state_dict(self) -> dict[str, Any]:
        """What decides each step's rollout besides the weights: the prompt order and the
        sampling settings (a rollout is a pure function of these, the step and the weights,
        so no sampler state needs saving)."""
        plan, settings = self.plan, self.settings
        return {
            "kind": "rollout",
            "num_rows": plan.num_rows,
            "global_batch": plan.global_batch,
            "seed": plan.seed,
            "shuffle": plan.shuffle,
            "num_generations": settings.num_generations,
            "max_completion_length": settings.max_completion_length,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "num_iterations": settings.num_iterations,
            "generation_batch_prompts": settings.generation_batch_prompts,
            "rewards": [f.name for f in self.ctx.rewards],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse a checkpoint whose rollouts were made another way: resuming would not
        continue the saved run."""
        differences = [
            f"{key} was {state_dict.get(key)!r} in the checkpoint, this run has {value!r}"
            for key, value in self.state_dict().items()
            if state_dict.get(key) != value
        ]
        if differences:
            raise CheckpointError(
                f"the checkpoint's rollouts were made differently ({'; '.join(differences)}): "
                f"resuming would not continue the saved run; set train.resume=never to start "
                f"over, or resume with the checkpoint's settings"
            )

    def process_state_dict(self) -> dict[str, Any] | None:
        """This process's rollout when a checkpoint falls inside its num_iterations steps
        (None otherwise: the next step samples a new one). Rows keep their old log-probs,
        whose floats JSON carries exactly."""
        rollout = self._rollout
        if (
            rollout is None
            or self._next_step >= rollout.generation_step + self.settings.num_iterations
        ):
            return None
        return {
            "generation_step": rollout.generation_step,
            "dp_rank": self.dist.dp_rank,
            "dp_size": self.dist.dp_size,
            # a row's images are its prompt's (prepared data, not JSON): found again on load
            "rows": [without_images(row) for micro in rollout.micro_batches for row in micro],
            "window_targets": rollout.window_targets,
            "window_tokens": rollout.window_tokens,
            "window_rows": rollout.rows,
            "metrics": rollout.metrics,
            "samples": [asdict(record) for record in rollout.samples],
        }

    def load_process_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """The rollout of the saved span, this process's share of it: the saved processes'
        rows joined in window order, then this rank's block (the same rows and micro-batches
        when the number of processes is the same). With no saved rollout (a checkpoint at
        a span's end, or an older keel's) the next step samples one."""
        if not states:
            return
        first = states[0]
        by_rank = {state["dp_rank"]: state for state in states}  # model-parallel twins agree
        if sorted(by_rank) != list(range(first["dp_size"])):
            raise CheckpointError(
                f"the checkpoint's rollout was saved by data-parallel ranks {sorted(by_rank)} "
                f"of {first['dp_size']}: a file of processes/ is missing; set "
                f"train.resume=never to start over, or resume from another checkpoint"
            )
        generation_step = first["generation_step"]
        window = self.plan.window(generation_step // self.settings.num_iterations)
        rows = [row for rank in sorted(by_rank) for row in by_rank[rank]["rows"]]
        if len(rows) != len(window) * self.group:
            raise CheckpointError(
                f"the checkpoint's rollout holds {len(rows)} completions, its step's "
                f"{len(window)} prompts x {self.group} make {len(window) * self.group}; set "
                f"train.resume=never to start over, or resume from another checkpoint"
            )
        groups = [rows[i * self.group : (i + 1) * self.group] for i in range(len(window))]
        for prompt, group in zip(window, groups):
            with_prompt_images(group, self.prompts[prompt])
        mine = [row for group in rank_block(groups, self.dist.dp_rank, self.dist.dp_size)
                for row in group]  # fmt: skip
        filler = mine[0] if mine else self._filler_row(window[0])
        filler.setdefault("old_logps", [0.0] * len(filler["input_ids"]))
        samples = by_rank[0]["samples"] if self.ctx.completions is not None else []
        self._rollout = _Rollout(
            generation_step=generation_step,
            micro_batches=self._micro_batches(mine, len(window)),
            filler=filler,
            window_targets=first["window_targets"],
            window_tokens=first["window_tokens"],
            rows=first["window_rows"],
            metrics=first["metrics"],
            samples=[CompletionRecord(**record) for record in samples],
        )

    def _samples(self, scored: ScoredPrompts) -> list[CompletionRecord]:
        names = [f.short for f in self.ctx.rewards]
        records = []
        for i, text in enumerate(scored.texts):
            row = self.prompts[scored.prompts[i // self.group]]
            reward = scored.rewards[i].item()
            records.append(
                CompletionRecord(
                    step=0,
                    prompt=json.loads(row["prompt"]),
                    completion=text,
                    rewards={n: _value(scored.scores[i, f].item()) for f, n in enumerate(names)},
                    reward=_value(reward),
                    advantage=scored.advantages[i].item(),
                    extra={name: values[i] for name, values in scored.extras.items()},
                )
            )
        return records


def _value(number: float) -> float | None:
    return None if math.isnan(number) else number


def _at_step(record: CompletionRecord, step: int) -> CompletionRecord:
    return replace(record, step=step)
