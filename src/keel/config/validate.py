"""Cross-field rules: things the field types alone cannot say. Returns problems, never raises."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from pathlib import Path

from keel.config.schema import (
    BUNDLED_PREFIX,
    RunConfig,
    WandbConfig,
)
from keel.config.validate_method import check_method, positive
from keel.config.validate_runtime import check_distributed, check_watchdog
from keel.extras import extra_problem
from keel.stages.base import Stage
from keel.stages.registry import STAGES, next_token_stages, spoken, stage_sections


def check_config(cfg: RunConfig) -> list[str]:
    """Every problem with a well-typed config, each naming its key, value and fix."""
    non_finite = _non_finite(cfg, "")
    if non_finite:  # every bound below compares numbers, and NaN passes none of them
        return non_finite
    return [
        *_check_model(cfg),
        *_check_added_tokens(cfg),
        *_check_vision(cfg),
        *check_method(cfg),
        *_check_data(cfg),
        *_check_train(cfg),
        *_check_stage(cfg),
        *_check_stage_sections(cfg),
        *_check_output(cfg),
        *check_distributed(cfg),
        *check_watchdog(cfg),
        *_check_extras(cfg),
    ]


def _non_finite(node, key: str) -> list[str]:
    """`key = value must be a finite number` for each inf or NaN float in the config (YAML
    and overrides are checked as they are read; this covers configs built in code)."""
    if dataclasses.is_dataclass(node):
        return [
            problem
            for f in dataclasses.fields(node)
            for problem in _non_finite(getattr(node, f.name), f"{key}{f.name}.")
        ]
    if isinstance(node, list):
        return [p for i, item in enumerate(node) for p in _non_finite(item, f"{key}{i}.")]
    if isinstance(node, float) and not math.isfinite(node):
        return [f"{key.rstrip('.')} = {node!r} must be a finite number"]
    return []


# owner/name as the Hub spells repo ids (huggingface_hub's validate_repo_id, two parts).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(path: str) -> bool:
    """`owner/name` that is not an existing local path: a Hugging Face Hub model id."""
    if path.startswith(BUNDLED_PREFIX) or not _HUB_ID.fullmatch(path):
        return False
    if "--" in path or ".." in path or path.endswith((".", "-", ".git")):
        return False
    return not Path(path).expanduser().exists()


def _check_model(cfg: RunConfig) -> list[str]:
    path = cfg.model.path
    if is_hub_id(path):
        return []  # resolved in the Hugging Face cache, or downloaded, by keel.models.hub
    problems = []
    if cfg.model.revision != "main":
        problems.append(
            f"model.revision = {cfg.model.revision!r} applies to Hugging Face Hub ids "
            f"(owner/name) only, and model.path = {path!r} is not one; drop model.revision"
        )
    if path.startswith(BUNDLED_PREFIX):
        return problems  # the name is checked where bundled models are known (keel.models)
    if not Path(path).expanduser().exists():
        problems.append(
            f"model.path = {path!r} does not exist; give an HF model directory, a Hugging "
            f"Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct, or "
            f"{BUNDLED_PREFIX}smollm2-135m-instruct"
        )
    return problems


def _check_added_tokens(cfg: RunConfig) -> list[str]:
    """Each added token is a non-empty string, named once in model.add_tokens and
    model.add_special_tokens together (a token is either plain or special)."""
    problems, seen = [], {}
    for key in ("add_tokens", "add_special_tokens"):
        for index, token in enumerate(getattr(cfg.model, key)):
            where = f"model.{key}[{index}]"
            if not token or not token.strip():
                problems.append(
                    f"{where} = {token!r}: a token needs at least one visible character"
                )
            elif token in seen:
                problems.append(f"{where} = {token!r} is also {seen[token]}; name each token once")
            else:
                seen[token] = where
    return problems


# The largest image keel decodes (keel.models.vision.images): a bigger limit could not apply.
MAX_IMAGE_PIXELS = 8192 * 8192


def _check_vision(cfg: RunConfig) -> list[str]:
    """model.vision's image size bounds (checked for every model: a config is validated
    before keel knows whether the model sees images)."""
    vision = cfg.model.vision
    problems = positive(vision.image_min_pixels, "model.vision.image_min_pixels")
    if vision.image_max_pixels > MAX_IMAGE_PIXELS:
        problems.append(
            f"model.vision.image_max_pixels = {vision.image_max_pixels} is above "
            f"{MAX_IMAGE_PIXELS} (8192*8192, the largest image keel decodes); lower it"
        )
    if vision.image_max_pixels < vision.image_min_pixels:
        problems.append(
            f"model.vision.image_max_pixels = {vision.image_max_pixels} is below "
            f"model.vision.image_min_pixels = {vision.image_min_pixels}; raise it or lower "
            f"image_min_pixels"
        )
    return problems


def _check_data(cfg: RunConfig) -> list[str]:
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


# What each kind of stage trains on, for data.train_on_prompt or mask_history outside sft.
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


_TRAINED_TOKENS = {
    "text": "every token is trained already",
    "pair": "it compares the answers to one prompt, so the prompt is never scored",
    "sample": "it scores the answer to a prompt, so the prompt is never scored",
    "prompt": "it trains on the completions it generates",
}


def _check_train(cfg: RunConfig) -> list[str]:
    t = cfg.train
    problems = positive(t.micro_batch_size, "train.micro_batch_size")
    problems += positive(t.grad_accum, "train.grad_accum")
    if t.global_batch_size is not None:
        problems += positive(t.global_batch_size, "train.global_batch_size")
        if t.grad_accum != 1:
            problems.append(
                f"train.grad_accum = {t.grad_accum} and train.global_batch_size = "
                f"{t.global_batch_size} both set the batch; set only one (with "
                f"global_batch_size, keel derives the accumulation per process)"
            )
    problems += positive(t.lr, "train.lr")
    problems += positive(t.loss_chunk_size, "train.loss_chunk_size")
    problems += positive(t.warmup_steps, "train.warmup_steps", allow_zero=True)
    problems += positive(t.weight_decay, "train.weight_decay", allow_zero=True)
    problems += positive(t.max_grad_norm, "train.max_grad_norm", allow_zero=True)
    problems += positive(t.threads, "train.threads", allow_zero=True)
    problems += positive(t.eval_every, "train.eval_every", allow_zero=True)
    problems += positive(t.evals_per_epoch, "train.evals_per_epoch", allow_zero=True)
    if t.eval_every and t.evals_per_epoch:
        problems.append(
            f"train.eval_every = {t.eval_every} and train.evals_per_epoch = "
            f"{t.evals_per_epoch} both set how often to evaluate; keep one"
        )
    if t.max_steps is None:
        problems += positive(t.epochs, "train.epochs")
    else:
        problems += positive(t.max_steps, "train.max_steps")
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(f"train.min_lr_ratio = {t.min_lr_ratio} must be in [0, 1]")
    if not 0 <= t.warmup_ratio < 1:
        problems.append(f"train.warmup_ratio = {t.warmup_ratio} must be in [0, 1)")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        problems.append(f"train.adam_betas = {t.adam_betas} must be two numbers in [0, 1)")
    problems += _router_balance_problems(t)
    problems += _token_weighting_problems(t)
    problems += _early_stopping_problems(cfg)
    if t.resume not in ("auto", "never") and not Path(t.resume).is_dir():
        problems.append(
            f"train.resume = {t.resume!r} must be auto, never, or an existing checkpoint folder"
        )
    return problems


def _early_stopping_problems(cfg: RunConfig) -> list[str]:
    """Early stopping needs periodic evaluations of held-out data."""
    t = cfg.train
    problems = positive(t.early_stopping_patience, "train.early_stopping_patience", allow_zero=True)
    problems += positive(
        t.early_stopping_threshold, "train.early_stopping_threshold", allow_zero=True
    )
    if problems or not t.early_stopping_patience:
        return problems
    key = f"train.early_stopping_patience = {t.early_stopping_patience}"
    if cfg.data.streaming and not cfg.data.eval_datasets:
        return [
            f"{key} judges evaluations, and there is no eval data: set data.eval_datasets "
            f"(data.streaming holds no rows out)"
        ]
    if not (cfg.data.val_size or cfg.data.eval_datasets):
        return [
            f"{key} judges evaluations, and there is no eval data: set data.val_size or data.eval_datasets"
        ]
    if not (t.eval_every or t.evals_per_epoch):
        return [
            f"{key} judges periodic evaluations: set train.eval_every (steps) or "
            "train.evals_per_epoch (e.g. 4)"
        ]
    return []


def _router_balance_problems(t) -> list[str]:
    """train.router_aux_loss_coef: a coefficient >= 0, or model; on the next-token stages."""
    setting = t.router_aux_loss_coef
    number = isinstance(setting, int | float) and not isinstance(setting, bool)
    if setting != "model" and not (number and setting >= 0):
        return [f"train.router_aux_loss_coef = {setting!r} must be a number >= 0, or model"]
    if setting == 0 or t.stage in next_token_stages():
        return []
    return [
        f"train.router_aux_loss_coef = {setting} adds the routers' balance to a next-token "
        f"loss (stage {spoken(next_token_stages())}), not to {t.stage}'s; set it to 0"
    ]


def _token_weighting_problems(t) -> list[str]:
    """train.token_weighting weights a next-token cross-entropy; eaft's settings in range."""
    problems = positive(t.eaft_alpha, "train.eaft_alpha", allow_zero=True)
    if t.eaft_top_k < 2:
        problems.append(
            f"train.eaft_top_k = {t.eaft_top_k} must be at least 2 (the entropy of one token is 0)"
        )
    if t.token_weighting != "none" and t.stage not in next_token_stages():
        problems.append(
            f"train.token_weighting = {t.token_weighting} weights a next-token "
            f"cross-entropy (stage {spoken(next_token_stages())}), not {t.stage}'s loss; "
            f"set it to none"
        )
    return problems


def _check_stage(cfg: RunConfig) -> list[str]:
    """train.stage names a registered stage (keel.stages.registry)."""
    name = cfg.train.stage
    if name in STAGES:
        return []
    close = difflib.get_close_matches(str(name), list(STAGES), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return [f"train.stage = {name!r} is not one of {', '.join(STAGES)}{hint}"]


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


def _check_stage_sections(cfg: RunConfig) -> list[str]:
    """Only train.stage's section is set, and its values pass the stage's own checks (a
    key of another stage's section is already an unknown key, keel.config.load)."""
    stage = STAGES.get(cfg.train.stage)
    if stage is None:  # _check_stage reports it
        return []
    problems = []
    for name in stage_sections():
        if name != stage.name and getattr(cfg, name, None) is not None:
            instead = f"write {stage.name}: instead" if stage.settings else f"remove {name}"
            problems.append(
                f"{name} is set but train.stage = {stage.name}: the {name} section holds the "
                f"settings of train.stage {name}; set train.stage = {name}, or {instead}"
            )
    settings = cfg.stage_settings
    return problems + (settings.problems(stage.name) if settings is not None else [])


def _check_output(cfg: RunConfig) -> list[str]:
    out = cfg.output
    problems = positive(out.log_every, "output.log_every")
    problems += positive(out.keep_last, "output.keep_last")
    problems += positive(out.save_every, "output.save_every", allow_zero=True)
    problems += positive(out.saves_per_epoch, "output.saves_per_epoch", allow_zero=True)
    if out.save_every and out.saves_per_epoch:
        problems.append(
            f"output.save_every = {out.save_every} and output.saves_per_epoch = "
            f"{out.saves_per_epoch} both set how often to save; keep one"
        )
    if "wandb" in out.loggers:
        problems += _check_wandb(out.wandb)
    elif out.wandb != WandbConfig():
        # Settings without the logger are most likely a run the user expects on W&B.
        problems.append(
            "output.wandb is set but output.loggers does not include wandb; "
            "add it (output.loggers=[jsonl, wandb]), or remove output.wandb"
        )
    return problems


def _check_extras(cfg: RunConfig) -> list[str]:
    """Optional extras the config needs: checked before any model or data loads."""
    needs = [(name, f"output.loggers with {name}") for name in ("tensorboard", "wandb")]
    needs = [(extra, why) for extra, why in needs if extra in cfg.output.loggers]
    qlora = cfg.method.qlora
    if cfg.method.type == "qlora":
        backend = "bnb" if qlora.quant_backend == "bnb" else "qlora"
        needs.append((backend, f"method.type = qlora with quant_backend {qlora.quant_backend}"))
    if cfg.train.optimizer != "adamw":
        needs.append(("qlora", f"train.optimizer = {cfg.train.optimizer}"))
    found = [extra_problem(extra, why) for extra, why in needs]
    return [problem for problem in found if problem]


def _check_wandb(w: WandbConfig) -> list[str]:
    # W&B's own rules (wandb.sdk.wandb_settings), checked before the model loads rather
    # than when wandb.init runs after it.
    problems = []
    if w.project is not None:
        if not 1 <= len(w.project) <= 128 or set(w.project) & set("/\\#?%:"):
            problems.append(
                f"output.wandb.project = {w.project!r} must be 1 to 128 "
                f"characters without / \\ # ? % :"
            )
    for index, tag in enumerate(w.tags):
        if not 1 <= len(tag) <= 64:
            problems.append(f"output.wandb.tags.{index} = {tag!r} must be 1 to 64 characters")
    return problems
