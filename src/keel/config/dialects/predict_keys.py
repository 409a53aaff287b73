"""LLaMA-Factory's predict config as keel predict's flags: `llamafactory-cli train X.yaml`
with `do_predict: true` and `predict_with_generate: true` answers each row of
`eval_dataset` and scores the answers (their examples/extras/nlg_eval). `keel predict X.yaml`
takes that file as it is. The keys it shares with their chat config (model, adapter,
template, sampling) are keel.config.dialects.commands'; these are the rest."""

from __future__ import annotations

from keel.config.dialects.build import Build

# their training and evaluation runtime settings: how their Trainer runs, not what it answers
_RUNTIME = (
    "per_device_eval_batch_size", "preprocessing_num_workers", "dataloader_num_workers",
    "overwrite_cache", "report_to", "ddp_timeout", "logging_steps",
    "plot_loss", "bf16", "fp16", "pure_bf16", "run_name", "preprocessing_batch_size",
    "tokenized_path", "streaming", "flash_attn", "use_unsloth", "enable_liger_kernel",
)  # fmt: skip
_DIRECT = {"dataset_dir": "dataset_dir", "cutoff_len": "cutoff_len", "seed": "seed"}


def predict_key(build: Build, key: str, value) -> bool:
    """Give `key` its fate when it is one of a predict config's own; False when it is not
    (a key their chat config has too: keel.config.dialects.commands handles it)."""
    if key == "eval_dataset":
        why = "names in dataset_dir's dataset_info.json: the rows answered"
        if value is None:
            build.refused(key, "null: their predict answers eval_dataset; name the datasets")
        else:
            build.mapped(key, "--data", why)
    elif key == "max_samples":
        _flag(build, key, "max_samples", value, "the first N rows of each dataset")
    elif key in _DIRECT:
        _flag(build, key, _DIRECT[key], value)
    elif key == "output_dir":
        _flag(build, key, "out", str(value), "a new folder: keel never writes into a full one")
    elif key == "dataset":
        build.ignored(key, "training data: their predict answers eval_dataset")
    elif key == "overwrite_output_dir":
        build.ignored(key, "keel never writes into a full folder: output_dir must be new or empty")
    elif key in ("do_predict", "predict_with_generate"):
        _switch_on(build, key, value)
    elif key in ("do_train", "do_eval"):
        if value:
            build.refused(key, "true: keel predict only predicts; train with keel train first")
        else:
            build.ignored(key, "false")
    elif key == "stage":
        if value == "sft":
            build.ignored(key, "sft: conversations answered by the model")
        else:
            build.refused(key, f"{value!r}: their predict runs with stage sft")
    elif key in _RUNTIME:
        build.ignored(key, "a runtime setting of their Trainer; keel predict batches itself")
    else:
        return False
    return True


def predict_rows(build: Build) -> None:
    """eval_dataset's names, comma-separated or a list, as --data entries."""
    names = build.raw.get("eval_dataset")
    if names is None:
        if "eval_dataset" not in build.raw:
            build.notes.append("no eval_dataset: the rows to answer come from --data")
        return
    listed = names if isinstance(names, list) else str(names).split(",")
    build.set("data", [{"path": str(n).strip()} for n in listed if str(n).strip()])
    if "dataset_dir" not in build.raw:
        build.set("dataset_dir", "data")
        build.notes.append("--dataset-dir data: LLaMA-Factory's default dataset_dir")


def _flag(build: Build, key: str, name: str, value, why: str = "") -> None:
    build.set(name, value)
    build.mapped(key, "--" + name.replace("_", "-"), why)


def _switch_on(build: Build, key: str, value) -> None:
    if value:
        build.ignored(key, "true: keel predict generates each answer")
    elif key == "do_predict":
        build.refused(key, "false: LLaMA-Factory would not predict; set do_predict: true")
    else:
        build.refused(
            key,
            "false: their predict then reports the loss alone; keel train reports it on "
            "data.eval_datasets, keel predict generates answers (set it true)",
        )
