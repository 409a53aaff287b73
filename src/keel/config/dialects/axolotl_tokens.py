"""Axolotl's tokenizer keys: `special_tokens` (the roles keel keeps its own, the tokens it
adds when new) and `tokens` (plain tokens added to the vocabulary)."""

from __future__ import annotations

from keel.config.dialects.build import Build
from keel.config.dialects.families import model_of


def special_tokens(build: Build, key: str, value) -> None:
    whys = {
        "pad_token": "keel pads with the tokenizer's pad token (else its eos); padding never "
        "enters the loss",
        "eos_token": "keel ends each turn with the chat template's own end token",
    }
    empty, what = "empty: the tokenizer's own tokens", "a mapping of token names to tokens"
    if not build.mapping(key, value, empty=empty, what=what):
        return
    model = model_of(build.raw, "base_model", "revision_of_model", build.model_override)
    own = model.special_tokens()
    for name, token in value.items():
        if name == "pad_token" or (name in whys and model.has_token(token)):
            build.ignored(f"{key}.{name}", whys[name])
        elif name in whys:  # the role is keel's own; the token joins the vocabulary if new
            _add_tokens(build, "model.add_special_tokens", [token])
            build.mapped(
                f"{key}.{name}",
                "model.add_special_tokens",
                f"{whys[name]}; {token!r} joins the vocabulary as a special token if new",
            )
        elif own is not None and own.get(name) == token:
            build.ignored(f"{key}.{name}", f"{token!r} is the tokenizer's own {name} already")
        else:
            build.refused(f"{key}.{name}", _special_token_refusal(name, token, model, own))


def added_tokens(build: Build, key: str, value) -> None:
    """Axolotl's `tokens`: plain tokens added to the tokenizer (model.add_tokens)."""
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        build.refused(key, f"{value!r}: tokens is a list of tokens to add, e.g. ['<think>']")
        return
    _add_tokens(build, "model.add_tokens", value)
    build.mapped(key, "model.add_tokens", "new ones get rows at the mean, trained in full")


def _add_tokens(build: Build, target: str, tokens: list[str]) -> None:
    """Add to model.add_tokens or model.add_special_tokens; a token named by both of their
    keys is special (their special_tokens marks it so after `tokens` adds it)."""
    section = build.config.setdefault("model", {})
    plain = section.setdefault("add_tokens", [])
    special = section.setdefault("add_special_tokens", [])
    if target == "model.add_special_tokens":
        special += [t for t in tokens if t not in special]
        plain[:] = [t for t in plain if t not in special]
    else:
        plain += [t for t in tokens if t not in plain and t not in special]
    for name, listed in (("add_tokens", plain), ("add_special_tokens", special)):
        if not listed:
            del section[name]


def _special_token_refusal(name: str, token, model, own: dict[str, str] | None) -> str:
    if own is None:
        return (
            f"keel does not change the tokenizer's special tokens, and {model.key}'s tokenizer "
            f"is not on this machine to compare {token!r} with its {name}; remove the key if "
            f"it is the tokenizer's own, else use a model whose tokenizer has it"
        )
    theirs = f"its {name} is {own[name]!r}" if name in own else f"it has no {name}"
    return (
        f"keel does not change the tokenizer's special tokens: {model.key}'s tokenizer is "
        f"not set up this way ({theirs}, this asks for {token!r}); remove the key (keel uses "
        f"the tokenizer's own), or use a model whose tokenizer has it"
    )


def mistral_common(build: Build, key: str, value) -> None:
    """tokenizer_use_mistral_common: their Mistral models tokenized by mistral-common."""
    if not value:
        build.ignored(key, "false: the Hugging Face tokenizer, as keel's")
    else:
        build.refused(
            key,
            "keel tokenizes with the model's Hugging Face tokenizer (tokenizer.json) and chat "
            "template on every machine, not mistral-common's encoder; remove the key to train "
            "with those (Mistral ships them beside tekken.json), which may render a chat "
            "differently from mistral-common",
        )
