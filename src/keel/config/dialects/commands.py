"""Their configs for chatting, serving and exporting, as keel chat, serve and export flags.

LLaMA-Factory's quickstart chats with `llamafactory-cli chat examples/inference/X.yaml`,
serves the same file with `llamafactory-cli api` and merges with `llamafactory-cli export
examples/merge_lora/X.yaml`; Axolotl's chats and merges with the training config itself
(`axolotl inference CONFIG`, `axolotl merge-lora CONFIG`). keel chat, serve and export take
those files as they are: what they set becomes the command's flags (by argparse name:
model, adapter, out, ...), each of their keys with a fate, as `keel train` reports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from keel.config.dialects import detect_dialect, unread_dialect
from keel.config.dialects.build import Build
from keel.config.dialects.families import model_of
from keel.config.dialects.predict_keys import predict_key, predict_rows
from keel.config.dialects.report import KeyFate, Translation, unknown_key
from keel.config.dialects.templates import template_fate
from keel.errors import ConfigError

Command = Literal["chat", "serve", "export", "predict"]

# LLaMA-Factory's generating arguments (hparams/generating_args.py): their defaults, and what
# keel chat's flags make of each (None: keel chat has no such setting)
_GENERATION_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.95,
    "top_p": 0.7,
    "top_k": 50,
    "num_beams": 1,
    "max_length": 1024,
    "max_new_tokens": 1024,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "skip_special_tokens": True,
}
_BACKENDS = ("huggingface", "vllm", "sglang", "ktransformers")
_EXPORT_KEYS = ("export_dir", "export_size", "export_device", "export_legacy_format")
_REFUSED_EXPORT = ("export_hub_model_id", "export_quantization_bit", "export_quantization_dataset")
_REMOTE_CODE = (
    "keel's chat, predict, serve and export load the architectures transformers ships (Qwen3 "
    "and Llama among them), without a model repository's own code"
)


def translate_command(raw: dict, source: Path, command: Command) -> Translation:
    """Their `raw` config (read from `source`) as keel `command`'s flags: a Translation whose
    config maps argparse names (model, adapter, out, max_shard_size, ...) to values."""
    unread = unread_dialect(raw)
    if unread is not None:
        raise ConfigError([f"{source}: {unread}"])
    dialect = detect_dialect(raw)
    if dialect is None:
        raise ConfigError(
            [
                f"{source} is neither a LLaMA-Factory config (model_name_or_path) nor an "
                f"Axolotl one (base_model); keel {command} takes their configs, or --model"
            ]
        )
    build = Build(raw=raw, source=Path(source), stage=None)
    if dialect == "llamafactory":
        for key, value in raw.items():
            if command != "predict" or not predict_key(build, str(key), value):
                _llamafactory_key(build, str(key), value, command)
        _generation_defaults(build, command)
        if command == "predict":
            predict_rows(build)
    else:
        _axolotl(build, command)
    return Translation(dialect=dialect, config=build.config, fates=build.fates, notes=build.notes)


def _flag(build: Build, key: str, name: str, value, why: str = "") -> None:
    """Their `key` becomes keel's flag `name` (argparse's name: max_shard_size) = `value`."""
    build.set(name, value)
    build.mapped(key, _flag_name(name), why)


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _llamafactory_key(build: Build, key: str, value, command: Command) -> None:
    if value is None:
        build.ignored(key, "null: their default")
    elif key == "model_name_or_path":
        _flag(build, key, "model", str(value))
    elif key == "adapter_name_or_path":
        _adapter(build, key, value, command)
    elif key == "template":
        model = model_of(build.raw, "model_name_or_path", "model_revision", {})
        fate, template = template_fate(key, value, model)
        build.fates.append(fate if template is None else _as_check(fate))
    elif key == "model_revision":
        if value in (None, "main"):
            build.ignored(key, "main: the revision keel loads")
        else:
            build.refused(key, f"{value!r}: keel {command} loads a Hub model's main revision; "
                          "download that revision and name its folder")  # fmt: skip
    elif key == "trust_remote_code":
        build.ignored(key, _REMOTE_CODE)
    elif key == "infer_backend":
        _backend(build, key, value, command)
    elif key in _GENERATION_DEFAULTS or key == "default_system":
        _generation(build, key, value, command)
    elif key in _EXPORT_KEYS or key in _REFUSED_EXPORT:
        _export_key(build, key, value, command)
    else:
        _other(build, key, value, command)


def _as_check(fate: KeyFate) -> KeyFate:
    """A template that is the model's own: keel's commands render with it, so there is no
    flag to set; the check stands."""
    return KeyFate(fate.key, "ignored", why=f"keel renders the model's own template ({fate.why})")


def _adapter(build: Build, key: str, value, command: Command) -> None:
    listed = value if isinstance(value, list) else str(value).split(",")
    adapters = [str(a).strip() for a in listed if str(a).strip()]
    if len(adapters) != 1:
        build.refused(
            key,
            f"{len(adapters)} adapters: keel {command} takes one; merge the others into the "
            f"base first (keel export, one adapter at a time) and name the merged model",
        )
    elif command == "serve":
        name = Path(adapters[0]).name
        build.set("adapter", [f"{name}={adapters[0]}"])
        build.mapped(key, "--adapter", f"served as model {name!r} beside the base")
    else:
        _flag(build, key, "adapter", adapters[0])


def _backend(build: Build, key: str, value, command: Command) -> None:
    if value not in _BACKENDS:
        build.refused(key, f"{value!r}: theirs are {', '.join(_BACKENDS)}")
    elif command == "export":
        build.ignored(key, "read by chat and api only")
    elif value == "huggingface":
        build.ignored(key, "huggingface: keel decodes with its own engine")
    elif value == "vllm" and command == "serve":
        _flag(build, key, "backend", "vllm", "needs vLLM and a CUDA GPU")
    elif value == "vllm":
        why = f"keel {command} decodes with its own engine (keel serve --backend vllm)"
        build.ignored(key, why)
    else:
        build.refused(key, f"{value}: keel serves with its own engine or vllm")


def _generation(build: Build, key: str, value, command: Command) -> None:
    """Their sampling settings: keel chat's and predict's flags; serve's requests each set
    their own."""
    if command not in ("chat", "predict"):
        build.ignored(key, "read by chat only" if command == "export" else _PER_REQUEST)
    elif key == "default_system":
        _flag(build, key, "system", value)
    elif key in ("temperature", "top_p", "max_new_tokens"):
        sampled = build.raw.get("do_sample", True)
        if key == "temperature" and not sampled:
            build.ignored(key, "do_sample is false: greedy")
        else:
            _flag(build, key, key, value)
    elif key == "do_sample":
        if value:
            build.ignored(key, "true: temperature and top_p sample")
        else:
            _flag(build, key, "temperature", 0.0, "false: greedy decoding")
    elif key == "max_length":
        build.ignored(key, "max_new_tokens bounds the answer (theirs drops max_length then)")
    elif value == _GENERATION_DEFAULTS[key]:
        build.ignored(key, f"{value}: their default, which keel {command} does too")
    else:
        build.refused(
            key, f"{value!r}: keel {command} samples with temperature and top_p only (greedy at 0)"
        )


_PER_REQUEST = "each request sets its own (temperature, top_p, max_tokens)"


def _generation_defaults(build: Build, command: Command) -> None:
    """Their chat and predict sample (temperature 0.95, top_p 0.7, 1024 new tokens) where
    keel's defaults are greedy and 256 (chat) or 512 (predict): their file left out means
    theirs."""
    if command not in ("chat", "predict"):
        return
    sampled = build.raw.get("do_sample", True)
    defaults = {"max_new_tokens": 1024}
    if sampled:
        defaults |= {"temperature": 0.95, "top_p": 0.7}
    for key, value in defaults.items():
        if key not in build.raw:
            build.set(key, value)
            build.notes.append(f"{_flag_name(key)} {value}: LLaMA-Factory's default {key}")
    if sampled and "top_k" not in build.raw:
        build.notes.append(f"top_k 50 (theirs) is not applied: keel {command} samples with top_p")


def _export_key(build: Build, key: str, value, command: Command) -> None:
    if key in _REFUSED_EXPORT:
        if value in (None, ""):
            build.ignored(key, "empty")
        else:
            why = (
                "keel does not upload; the model is written to export_dir"
                if key == "export_hub_model_id"
                else "keel export writes the merged model unquantised (GPTQ is not available)"
            )
            build.refused(key, why)
    elif command != "export":
        build.ignored(key, "read by export only")
    elif key == "export_dir":
        _flag(build, key, "out", str(value))
    elif key == "export_size":
        _flag(
            build, key, "max_shard_size", f"{value}GB", "safetensors files of at most that many GB"
        )
    elif key == "export_device":
        build.ignored(key, "keel export merges on the CPU")
    elif value:
        build.refused(key, "true: keel writes safetensors files only")
    else:
        build.ignored(key, "false: safetensors files, as keel writes")


def _other(build: Build, key: str, value, command: Command) -> None:
    known = (
        "model_name_or_path", "adapter_name_or_path", "template", "trust_remote_code",
        "infer_backend", "default_system", *_GENERATION_DEFAULTS, *_EXPORT_KEYS,
    )  # fmt: skip
    if key == "finetuning_type":
        build.ignored(key, "adapter_name_or_path decides whether an adapter is applied")
    elif key in ("enable_thinking", "infer_dtype", "flash_attn") or key.startswith("vllm_"):
        build.ignored(key, f"keel {command} renders the model's own template in its own dtype")
    elif key == "quantization_bit" and value is not None:
        build.refused(key, f"keel {command} loads the model unquantised")
    else:
        why = "not a key of LLaMA-Factory's chat, api or export configs keel knows; remove it"
        build.refused(key, unknown_key(key, known, why))


def _axolotl(build: Build, command: Command) -> None:
    """Axolotl's training config: what it trained (output_dir) is what keel chats with,
    serves or merges; a LoRA run's adapter goes on base_model, as `axolotl inference` and
    `merge-lora` put it. A merge goes to output_dir/merged, as theirs."""
    raw = build.raw
    out = str(raw.get("output_dir") or "./model-out")
    lora = raw.get("adapter") in ("lora", "qlora")
    for key in raw:
        if key == "base_model" and lora:
            _flag(build, key, "model", str(raw[key]), "the base the adapter trained on")
        elif key == "output_dir":
            _trained(build, key, out, lora, command)
        elif key == "adapter":
            build.ignored(
                key, f"{raw[key]}: output_dir holds {'an adapter' if lora else 'the model'}"
            )
        else:
            build.ignored(str(key), f"read by training; keel {command} reads what it wrote")
    if "output_dir" not in raw:
        _trained(build, None, out, lora, command)
    if command == "export":
        build.set("out", str(Path(out) / "merged"))
        build.notes.append(f"--out {Path(out) / 'merged'}: where axolotl merge-lora writes")
    if command == "predict":
        build.set("out", str(Path(out) / "predict"))
        build.notes.append(
            f"--out {Path(out) / 'predict'}; the rows to answer come from --data (their "
            f"datasets are read by training)"
        )


def _trained(build: Build, key: str | None, out: str, lora: bool, command: Command) -> None:
    """The folder the training wrote (their output_dir, ./model-out by default)."""
    if lora and command == "serve":
        name = Path(out).name
        build.set("adapter", [f"{name}={out}"])
        target, why = "--adapter", f"the trained adapter, served as model {name!r}"
    elif lora:
        build.set("adapter", out)
        target, why = "--adapter", "the trained adapter"
    else:
        build.set("model", out)
        target, why = "--model", "the trained model"
    if key is None:
        build.notes.append(f"{target} {out}: Axolotl's default output_dir, {why}")
    else:
        build.mapped(key, target, why)
