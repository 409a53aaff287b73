"""Axolotl's RL keys (`rl`, `rl_beta`, the per-method keys and the `trl:` section) as keel's
train.stage and the stage's own section (dpo, kto, orpo, simpo, grpo)."""

from __future__ import annotations

from pathlib import Path

from keel.config.dialects.build import Build

_RL = ("dpo", "ipo", "orpo", "simpo", "kto", "grpo")
_BETA_STAGES = ("dpo", "kto", "simpo", "orpo", "grpo")
# their key -> (the stage it belongs to, the keel key in that stage's section)
_STAGE_KEYS = {
    "orpo_alpha": ("orpo", "beta"),
    "kto_desirable_weight": ("kto", "desirable_weight"),
    "kto_undesirable_weight": ("kto", "undesirable_weight"),
    "simpo_gamma": ("simpo", "gamma"),
    "dpo_label_smoothing": ("dpo", "label_smoothing"),
    "center_rewards_coefficient": ("rm", "center_rewards_coefficient"),
}
_TRL_DIRECT = (
    "beta",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "reward_weights",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "mask_truncated_completions",
)
# every top-level key translate_stage_key gives a fate
STAGE_KEYS = ("rl", "reward_model", "rl_beta", *_STAGE_KEYS, "cpo_alpha", "trl", "num_labels")
_TRL_GENERATION = "keel generates the completions with its own engine in the training process"
_TRL_IGNORED = {
    "use_vllm": _TRL_GENERATION,
    "vllm_mode": _TRL_GENERATION,
    "vllm_server_host": _TRL_GENERATION,
    "vllm_server_port": _TRL_GENERATION,
    "vllm_server_timeout": _TRL_GENERATION,
    "vllm_lora_sync": _TRL_GENERATION,
    "vllm_gpu_memory_utilization": _TRL_GENERATION,
    "use_data_producer": _TRL_GENERATION,
    "log_completions": "keel logs the rewards and completion lengths in metrics.jsonl",
}


def translate_stage_key(build: Build, key: str, value) -> bool:
    """Give `key` its fate when it is one of the RL keys; False when it is not."""
    if key == "rl":
        _rl(build, key, value)
    elif key == "reward_model":
        if value:
            build.put(key, "train.stage", "rm", "a scalar reward head trained on pairs")
        else:
            build.ignored(key, "false: not a reward model")
    elif key in ("rl_beta", "orpo_alpha") and _beta_from(build.raw) != key and value is not None:
        # Axolotl takes the beta from trl.beta, else rl_beta, else orpo_alpha
        build.ignored(key, f"{_beta_from(build.raw)} sets the beta; Axolotl reads it first")
    elif key == "rl_beta":
        _in_stage(build, key, value, _BETA_STAGES, "beta")
    elif key in _STAGE_KEYS:
        stage, name = _STAGE_KEYS[key]
        _in_stage(build, key, value, (stage,), name)
    elif key == "cpo_alpha":
        _cpo_alpha(build, key, value)
    elif key == "num_labels":
        _num_labels(build, key, value)
    elif key == "trl":
        _trl(build, key, value)
    else:
        return False
    return True


def _beta_from(raw: dict) -> str | None:
    """Which key sets the preference beta in Axolotl (trl.beta, rl_beta, orpo_alpha)."""
    trl = raw.get("trl")
    if isinstance(trl, dict) and trl.get("beta") is not None:
        return "trl.beta"
    return next((key for key in ("rl_beta", "orpo_alpha") if raw.get(key) is not None), None)


# TRL's CPO trainer, which Axolotl's simpo runs, adds cpo_alpha x the chosen answers' NLL
# (a behaviour-cloning term) and defaults it to 1.0; keel's SimPO is the loss alone
_CPO_WHY = "keel's SimPO has no SFT (behaviour-cloning) term: set cpo_alpha: 0"


def _cpo_alpha(build: Build, key: str, value) -> None:
    if build.stage != "simpo":
        build.ignored(key, f"used with rl: simpo only (this run is {build.stage})")
    elif value in (0, 0.0):
        build.ignored(key, "0: no SFT term, as in keel's SimPO")
    elif value is None:
        build.refused(key, f"empty: TRL's CPO default 1.0 adds an SFT term; {_CPO_WHY}")
    else:
        build.refused(key, f"{value}: an SFT term beside the SimPO loss; {_CPO_WHY}")


def stage_defaults(build: Build) -> None:
    """Axolotl's RL defaults that keel cannot follow, refused though the key is left out."""
    if build.stage == "simpo" and "cpo_alpha" not in build.raw:
        build.refused("cpo_alpha", f"left out: TRL's CPO default 1.0 adds an SFT term; {_CPO_WHY}")


def _rl(build: Build, key: str, value) -> None:
    if value is None:
        build.ignored(key, "empty: supervised fine-tuning")
    elif value in _RL:
        note = "DPO with the IPO loss (dpo.loss_type ipo)" if value == "ipo" else ""
        build.put(key, "train.stage", build.stage, note)
        if value == "ipo":
            build.set("dpo.loss_type", "ipo")
    else:
        build.refused(key, f"rl: {value!r}; keel's RL stages are {', '.join(_RL)}")


def _num_labels(build: Build, key: str, value) -> None:
    if build.stage == "rm" and value in (None, 1):
        build.ignored(key, "1: a reward model's one score (keel's score head: hidden -> 1)")
    else:
        build.refused(
            key,
            f"{value!r}: keel trains sequence classifiers with one score, reward models "
            f"(reward_model: true) only",
        )


def _in_stage(build: Build, key: str, value, stages: tuple, name: str) -> None:
    if value is None:
        build.ignored(key, "empty: the stage's default")
    elif build.stage in stages:
        build.put(key, f"{build.stage}.{name}", value)
    else:
        build.ignored(key, f"used with rl: {' or '.join(stages)} only (this run is {build.stage})")


def _trl(build: Build, key: str, value) -> None:
    if not isinstance(value, dict):
        build.ignored(key, "empty") if value is None else build.refused(key, "must be a mapping")
        return
    for name, item in value.items():
        dotted = f"{key}.{name}"
        if name == "beta" and build.stage in _BETA_STAGES and item is not None:
            build.put(dotted, f"{build.stage}.beta", item, "Axolotl's beta for every RL stage")
        elif build.stage != "grpo":
            build.ignored(dotted, f"keel reads trl: with rl: grpo only (this run is {build.stage})")
        elif name in _TRL_DIRECT:
            build.put(dotted, f"grpo.{name}", item)
        elif name == "reward_funcs":
            rewards = [_reward(build.source, spec) for spec in item or []]
            build.put(dotted, "grpo.rewards", rewards, "called as TRL calls reward functions")
        elif name == "loss_type" and item in ("grpo", "dr_grpo", "dapo"):
            build.put(dotted, "grpo.loss_type", item)
        elif name == "scale_rewards":
            scale = {True: "group", False: "none"}.get(item, item)
            build.put(dotted, "grpo.scale_rewards", scale)
        elif name in _TRL_IGNORED:
            build.ignored(dotted, _TRL_IGNORED[name])
        else:
            build.refused(dotted, "a TRL setting keel's grpo has no counterpart for; remove it")


def _reward(source: Path, spec: str) -> str:
    """Axolotl's `module.function` (imported from the working directory) as keel's
    `file.py:function` when the file is beside the config, else `module:function`."""
    module, _, function = str(spec).rpartition(".")
    if not module:
        return str(spec)  # keel's loader reports it with its fix
    beside = Path(*module.split(".")).with_suffix(".py")
    if (source.parent / beside).is_file():
        return f"{beside.as_posix()}:{function}"
    return f"{module}:{function}"
