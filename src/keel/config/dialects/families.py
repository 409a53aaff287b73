"""Whether a chat template named after a model family fits the model being trained.

Their `template: qwen3` renders every row in Qwen3's format whatever the model; keel renders
with the model's own chat template. The two agree when the model is of that family, so the
translation reads the model's type (config.json's `model_type`) where it can without a
download, and refuses a family template on a model of another family. The check is by
architecture: several families share one (Llama 2, Llama 3, Yi and SmolLM are all `llama`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from keel.config.dialects.report import KeyFate
from keel.config.schema import BUNDLED_PREFIX
from keel.config.validate import is_hub_id


@dataclass(frozen=True)
class Model:
    """The model their config names, as far as the translation can see it."""

    key: str  # their key that names it ("model_name_or_path", "base_model")
    path: str
    type: str | None  # config.json's model_type; None where it cannot be read here
    revision: str = "main"

    def special_tokens(self) -> dict[str, str] | None:
        """The tokenizer's named special tokens (bos_token, eos_token, unk_token, ...) from
        its tokenizer_config.json and special_tokens_map.json (older tokenizers keep them
        there), None where neither is on this machine."""
        tokens, found_any = {}, False
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            saved = _json_file(_local_file(self.path, self.revision, name))
            found_any = found_any or saved is not None
            for key, value in (saved or {}).items():
                if isinstance(value, dict):  # an AddedToken as transformers saves it
                    value = value.get("content")
                if key.endswith("_token") and isinstance(value, str):
                    tokens[key] = value
        return tokens if found_any else None

    def has_token(self, token: str) -> bool | None:
        """Whether the tokenizer (its tokenizer.json) holds `token`, as a vocabulary entry
        or an added token; None where that file is not on this machine."""
        saved = _json_file(_local_file(self.path, self.revision, "tokenizer.json"))
        if saved is None:
            return None
        added = {entry.get("content") for entry in saved.get("added_tokens") or []}
        vocab = (saved.get("model") or {}).get("vocab")
        return token in added or (isinstance(vocab, dict) and token in vocab)


def _json_file(path: Path | None) -> dict | None:
    """A JSON object file's contents; None when it is absent or not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8")) if path else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def model_of(raw: dict, key: str, revision_key: str, override: dict) -> Model:
    """The model that trains: `raw[key]`, or keel's model.path when the command line sets it
    (`override`, keel's model section), with its type when its config.json is on this
    machine: a local folder, or a Hub id already in the Hugging Face cache (nothing is
    downloaded)."""
    revision = str(override.get("revision", raw.get(revision_key)) or "main")
    if override.get("path"):
        key, path = "model.path", str(override["path"])
    else:
        path = str(raw.get(key) or "")
    return Model(key=key, path=path, type=_model_type(path, revision), revision=revision)


def _model_type(path: str, revision: str) -> str | None:
    """config.json's model_type where the file is on this machine (else keel's loader says
    what is missing)."""
    found = (_json_file(_local_file(path, revision, "config.json")) or {}).get("model_type")
    return str(found) if found else None


def _local_file(path: str, revision: str, name: str) -> Path | None:
    """The model's file `name` on this machine, None where it would need a download."""
    if not path or path.startswith(BUNDLED_PREFIX):
        return None
    if Path(path).expanduser().is_dir():
        return Path(path).expanduser() / name
    if not is_hub_id(path):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(path, name, revision=revision)
    except ValueError:  # huggingface_hub's checks of the id and the revision
        return None
    return Path(found) if isinstance(found, str) else None


def of_family(model_type: str, types: tuple[str, ...]) -> bool:
    """Whether `model_type` is one of `types` or a variant of one (`qwen3` covers
    `qwen3_moe`; `gemma3` covers `gemma3_text` but not `gemma3n`)."""
    return any(model_type == name or model_type.startswith(f"{name}_") for name in types)


def family_fate(key: str, name: str, family: str, model: Model, choices: Choices) -> KeyFate:
    """The fate of template `name` (the `family` models' format): mapped to keel's `auto`
    when `model` is of that family or its type cannot be read here, refused when it is of
    another."""
    types = choices.types.get(name)
    own = f"{name} is the {family} models' chat format"
    if model.type is None:
        why = (
            f"auto: {own}; keel uses the tokenizer's chat template of {model.key}, not "
            f"checked against it here (its config.json is not on this machine yet)"
        )
        return KeyFate(key, "mapped", "data.template", why)
    if types is None:
        why = (
            f"auto: {own}; keel uses the tokenizer's chat template of {model.key} (model_type "
            f"{model.type}; keel has no list of the model types {name} is for)"
        )
        return KeyFate(key, "mapped", "data.template", why)
    if of_family(model.type, types):
        why = (
            f"auto: {own}, and {model.key} is one (model_type {model.type}): keel uses its "
            f"tokenizer's chat template"
        )
        return KeyFate(key, "mapped", "data.template", why)
    return KeyFate(key, "refused", why=_mismatch(key, own, name, model, choices))


@dataclass(frozen=True)
class Choices:
    """A dialect's family templates: name -> the model types it is for, and how their config
    asks for the model's own template."""

    types: dict[str, tuple[str, ...]]
    own: str  # "leave template out", "set chat_template: tokenizer_default"


def _mismatch(key: str, own: str, name: str, model: Model, choices: Choices) -> str:
    fits = [other for other, kinds in choices.types.items() if of_family(model.type, kinds)]
    shown = ", ".join(fits[:4]) + (", ..." if len(fits) > 4 else "")
    family = f", or set {key} to a {model.type} template ({shown})" if fits else ""
    return (
        f"{own}, but {model.key} {model.path} is a {model.type} model (config.json's "
        f"model_type); keel renders chat with the model's own template, not {name}'s: "
        f"{choices.own} (the model's own template){family}; or, to keep {name}'s format, "
        f"write it as a .jinja file for data.template in a keel config"
    )
