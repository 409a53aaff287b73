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
from keel.config.validate_data import check_data
from keel.config.validate_method import check_method, positive
from keel.config.validate_runtime import check_distributed, check_watchdog
from keel.extras import extra_problem
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
        *check_data(cfg),
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
