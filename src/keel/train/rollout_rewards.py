"""What a GRPO rollout hands its reward functions and takes back from them: the keyword
arguments of one scoring (TRL's: the prompts, completions, dataset columns and, on a
vision-language run, the prompt's images), and the metrics the functions logged with
`log_metric`, averaged over every process's calls."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from keel.data.encode_prompt import IMAGE_REFS
from keel.errors import ImageError
from keel.rewards import RewardInputs, TrainerState

if TYPE_CHECKING:
    from datasets import Dataset

    from keel.config import RunConfig
    from keel.distributed.process_group import DistContext

# The keys of every logged step's record besides the stage's and the source's own
# (keel.train.run_loop): a reward function's metric may not take one of these names.
STEP_RECORD_KEYS = frozenset(
    {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "real_tokens",
     "step_seconds", "target_tokens", "training_tokens_per_s", "kl",
     # keel.train.metrics.memory_now's, on a CPU and on a GPU
     "rss_mb", "peak_rss_mb", "cuda_alloc_mb", "cuda_peak_mb", "cuda_reserved_mb",
     "cuda_peak_reserved_mb"}
)  # fmt: skip


def run_trainer_state(cfg: RunConfig, total_steps: int, dist: DistContext) -> TrainerState:
    """trainer_state's fields that hold for the whole run on this process (the rollouts set
    global_step and epoch at each step)."""
    return TrainerState(
        global_step=0,
        max_steps=total_steps,
        num_train_epochs=cfg.train.epochs,
        logging_steps=cfg.output.log_every,
        is_world_process_zero=dist.is_main,
        is_local_process_zero=dist.local_rank == 0,
    )


def reward_inputs(
    prompts: Dataset, block: list[int], completions: list, state: TrainerState
) -> RewardInputs:
    """The reward functions' keyword arguments for `completions` ((token_ids, text) pairs,
    `group` = len(completions) / len(block) per prompt of `block`, in order): each prompt
    and dataset column repeated for each of its completions; `state`: trainer_state."""
    group = len(completions) // max(len(block), 1)
    listed, columns, where = [], {}, []
    for index, row in enumerate(block):
        record = prompts[row]
        prompt = json.loads(record["prompt"])
        extra = json.loads(record["columns"])
        if IMAGE_REFS in record:  # the same decoded images for each of its completions
            extra |= _prompt_images(record[IMAGE_REFS], row)
        for sample in range(group):
            listed.append(prompt)
            where.append(f"prompt {index} (row {row}), sample {sample}")
            for key, value in extra.items():
                columns.setdefault(key, []).append(value)
    conversational = bool(listed) and isinstance(listed[0], list)
    texts = [text for _, text in completions]
    shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    return RewardInputs(
        prompts=listed,
        completions=shown,
        completion_ids=[list(ids) for ids, _ in completions],
        columns=columns,
        where=where,
        step=state.global_step,
        state=state,
    )


def _prompt_images(refs_json: str, row: int) -> dict[str, list]:
    """{images column's name: the prompt's images as RGB PIL images}, as TRL passes an image
    dataset's column; ImageError naming the row when an image file is gone since encoding."""
    from keel.models.vision.images import load_image

    stored = json.loads(refs_json)
    try:
        return {stored["column"]: [load_image(ref) for ref in stored["refs"]]}
    except ImageError as error:
        raise ImageError(
            f"prompt row {row}'s images, read again for the reward functions: {error} (keep "
            "the data's image files in place for the whole run)"
        ) from None


def reserved_metrics(reward_metrics: list[str], stage_metrics: list[str]) -> frozenset[str]:
    """The names a reward function's `log_metric` may not use: those of the step record
    (its fixed keys, the rollout's metrics `reward_metrics`, the stage's `stage_metrics`)."""
    return STEP_RECORD_KEYS | frozenset(reward_metrics) | frozenset(stage_metrics)


def logged_metrics(dist: DistContext, logged: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Each metric the reward functions logged on any process, averaged over every value
    logged on every process (TRL's rule); one object gather, made by every process whether
    or not it logged anything (a process without prompts too). NaN for a metric whose every
    value was NaN."""
    totals: dict[str, list[float]] = {}
    for part in dist.gather_objects(logged):
        for name, (total, count) in part.items():
            summed = totals.setdefault(name, [0.0, 0])
            summed[0] += total
            summed[1] += count
    return {
        name: total / count if count else float("nan")
        for name, (total, count) in sorted(totals.items())
    }
