"""The data section's cross-field rules: dataset entries and their formats for the stage,
lengths, mixing, streaming. Returns problems, never raises (keel.config.validate)."""

from __future__ import annotations

from pathlib import Path

from keel.config.schema import RunConfig
from keel.config.validate_method import positive
from keel.stages.base import Stage
from keel.stages.registry import STAGES, spoken


def check_data(cfg: RunConfig) -> list[str]:
    """The data section's cross-field rules (and the stage's formats)."""
    data = cfg.data
    problems = []
    if not data.datasets:
        problems.append("data.datasets is empty; list at least one dataset file or name")
    if data.cutoff_len < 8:
        problems.append(f"data.cutoff_len = {data.cutoff_len} must be >= 8 tokens")
    if data.val_size < 0 or (data.val_size >= 1 and data.val_size != int(data.val_size)):
        problems.append(
            f"data.val_size = {data.val_size} must be a fraction in [0, 1) "
            f"or a whole number of samples"
        )
    if data.val_size and data.eval_datasets:
        problems.append(
            f"data.val_size = {data.val_size} and data.eval_datasets both choose the evaluation "
            f"data; keep one (val_size holds rows of data.datasets out)"
        )
    problems += positive(data.num_proc, "data.num_proc")
    problems += positive(data.max_row_bytes, "data.max_row_bytes")
    stage = STAGES.get(cfg.train.stage)  # None: _check_stage reports it
    if stage and stage.unit == "prompt" and data.packing:
        problems.append(
            f"data.packing = true: train.stage {stage.name} is trained on completions generated "
            f"from one prompt at a time, so prompt rows are never packed; set data.packing=false "
            f"(train.padding_free already lays a micro-batch's completions end to end)"
        )
    for key in ("train_on_prompt", "mask_history"):
        if stage and getattr(data, key) and stage.unit != "conversation":
            problems.append(
                f"data.{key} = true applies to train.stage sft (it is {stage.name}: "
                f"{_TRAINED_TOKENS.get(stage.unit, 'it trains its own tokens')}); remove it"
            )
    problems += _min_len_problems(data, stage)
    problems += _mix_problems(data)
    if stage and data.overlength == "split" and stage.unit != "text":
        problems.append(
            f"data.overlength = split cuts pretraining text (train.stage pt) into pieces; "
            f"train.stage {stage.name}'s samples would lose their prompt or answer: use drop, "
            f"truncate or error"
        )
    if data.streaming:
        problems += _streaming_problems(cfg, stage)
    if data.train_on_prompt and data.mask_history:
        problems.append(
            "data.train_on_prompt and data.mask_history are both true: one trains every token, "
            "the other the last answer only; set one of them"
        )
    for index, ds in enumerate(data.datasets):
        if stage and ds.format != "auto" and ds.format not in stage.formats:
            problems.append(_format_problem(f"data.datasets.{index}.format", ds.format, stage))
        if ds.max_samples is not None:
            problems += positive(ds.max_samples, f"data.datasets.{index}.max_samples")
        if ds.files and ds.subset is not None:
            problems.append(
                f"data.datasets.{index}.files and .subset both choose what of the Hub dataset "
                f"is read (files: those files as its train split); keep one"
            )
        if ds.num_samples is not None:
            problems += positive(ds.num_samples, f"data.datasets.{index}.num_samples")
    if data.dataset_dir is not None and not Path(data.dataset_dir).is_dir():
        problems.append(
            f"data.dataset_dir = {data.dataset_dir!r} is not a folder; it should "
            f"hold a dataset_info.json"
        )
    return problems


def _mix_problems(data) -> list[str]:
    """data.mix and mix_weights: one probability per dataset, for the interleave mixes."""
    weights = data.mix_weights
    if data.mix == "concat":
        if weights:
            return [
                "data.mix_weights apply to the interleave mixes; data.mix is concat (every "
                "row of each dataset): set data.mix interleave_under, interleave_over or "
                "interleave_once, or remove the weights"
            ]
        return []
    problems = []
    if not weights:
        return problems
    for name, entries in (
        ("data.datasets", data.datasets),
        ("data.eval_datasets", data.eval_datasets),
    ):
        count = len(entries)
        if count and len(weights) != count:
            problems.append(
                f"data.mix_weights has {len(weights)} weight(s) and {name} {count} "
                f"entries: give one weight per dataset"
            )
    if (
        any(not isinstance(w, int | float) or w < 0 for w in weights)
        or abs(sum(weights) - 1) > 1e-6
    ):
        problems.append(
            f"data.mix_weights = {list(weights)} must be probabilities >= 0 that sum to 1"
        )
    return problems


def _min_len_problems(data, stage) -> list[str]:
    """data.min_len: a whole number of tokens up to cutoff_len, for pt and sft samples."""
    if data.min_len == 0:
        return []
    key = f"data.min_len = {data.min_len}"
    if not isinstance(data.min_len, int) or isinstance(data.min_len, bool) or data.min_len < 0:
        return [f"{key} must be a whole number of tokens >= 0 (0: keep every length)"]
    if data.min_len > data.cutoff_len:
        return [
            f"{key} is over data.cutoff_len = {data.cutoff_len}: no sample could be both long "
            f"enough and short enough; lower it or raise cutoff_len"
        ]
    if stage and stage.unit not in ("text", "conversation"):
        return [
            f"{key} drops short pt and sft samples; train.stage {stage.name}'s "
            f"{stage.unit}s are not filtered by length: remove it"
        ]
    return []


def _streaming_problems(cfg: RunConfig, stage) -> list[str]:
    """What data.streaming cannot do: it reads the rows once, in order, as training goes, so
    nothing that needs them all first (their number, a sample of them, a held-out part)."""
    data, problems = cfg.data, []
    if stage and stage.unit not in ("text", "conversation"):
        problems.append(
            f"data.streaming = true reads pretraining (pt) and SFT (sft) data; train.stage "
            f"{stage.name}'s data is prepared whole: set data.streaming=false"
        )
    if cfg.train.max_steps is None:
        problems.append(
            "data.streaming = true: the streamed data's length is not known before training, "
            "so train.epochs cannot set the run's length; set train.max_steps"
        )
    needs_all = {
        "data.val_size": data.val_size,
        "data.deduplicate": data.deduplicate,
        "train.evals_per_epoch": cfg.train.evals_per_epoch,
        "output.saves_per_epoch": cfg.output.saves_per_epoch,
    }
    for index, ds in enumerate(data.datasets):
        needs_all[f"data.datasets.{index}.num_samples"] = ds.num_samples
        needs_all[f"data.datasets.{index}.max_samples"] = ds.max_samples
        if "[" in ds.split:
            needs_all[f"data.datasets.{index}.split"] = ds.split
    problems += [
        f"{key} = {value!r} needs the whole training data before training, which "
        f"data.streaming = true does not read ahead; remove it, or set data.streaming=false"
        + (
            " (data.eval_datasets, evaluation data of its own, works with it)"
            if key == "data.val_size"
            else ""
        )
        for key, value in needs_all.items()
        if value
    ]
    return problems


# What each kind of stage trains on, for data.train_on_prompt or mask_history outside sft.
_TRAINED_TOKENS = {
    "text": "every token is trained already",
    "pair": "it compares the answers to one prompt, so the prompt is never scored",
    "sample": "it scores the answer to a prompt, so the prompt is never scored",
    "prompt": "it trains on the completions it generates",
}


def _format_problem(key: str, fmt: str, stage: Stage) -> str:
    """`key` = `fmt` names data that `stage` does not train on: say which stages do."""
    users = [s.name for s in STAGES.values() if fmt in s.formats]
    if fmt == "text":
        return (
            f"{key} = text has no assistant turns to learn; use train.stage = "
            f"{spoken(users)}, or a chat format for {stage.name}"
        )
    holds = {"preference": "pairs", "kto": "labelled samples", "prompt": "prompts alone"}.get(
        fmt, f"{fmt} data"
    )
    which = f" = {users[0]}" if len(users) == 1 else ""
    return (
        f"{key} = {fmt} holds {holds} for train.stage {spoken(users)} (it is "
        f"{stage.name}); set train.stage{which}, or the format"
    )
