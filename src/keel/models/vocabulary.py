"""Tokens added to the tokenizer (model.add_tokens, model.add_special_tokens), and the
embedding rows they need.

A token new to the vocabulary gets the next id, so the input embeddings (and an untied
output layer) may need more rows than the checkpoint has. Every row that no training has
shaped yet (an added token's, and any row past the checkpoint's) starts at the mean of the
rows the model knows: its tokens then look like an average token rather than like noise,
and the output layer gives them an average logit, not a random one. The mean is computed,
not sampled, so one process and many start from identical weights.

Training grows the model on the meta device and fills the new rows while loading
(keel.models.materialize); a saved model already has its rows, and inference grows a base
to its adapter's tokenizer (`fit_vocabulary`) before the adapter's weights go on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from keel.config.schema import MethodConfig, ModelConfig

Log = Callable[[str], None]


@dataclass(frozen=True)
class AddedTokens:
    """What model.add_tokens and model.add_special_tokens did to a tokenizer."""

    new_ids: tuple[int, ...]  # ids of the tokens that were not in the vocabulary
    known: int  # the tokenizer's length before: rows [0, known) are tokens the model knows
    size: int  # the tokenizer's length after

    def describe(self) -> str:
        ids = ", ".join(map(str, self.new_ids[:8])) + (", ..." if len(self.new_ids) > 8 else "")
        return f"{len(self.new_ids)} new token(s) (ids {ids}); the tokenizer has {self.size}"


def add_configured_tokens(tokenizer, model_cfg: ModelConfig) -> AddedTokens | None:
    """Add model.add_tokens (plain) and model.add_special_tokens (special: never split,
    skipped when decoding without special tokens) to `tokenizer` in place. None when the
    config adds nothing new (no tokens, or all of them already in the vocabulary)."""
    wanted = [*model_cfg.add_tokens, *model_cfg.add_special_tokens]
    if not wanted:
        return None
    known = len(tokenizer)
    vocab = tokenizer.get_vocab()
    # A token the tokenizer has stays as it is (marking it special would change how text
    # holding it encodes, and what the data cache holds).
    plain = [t for t in model_cfg.add_tokens if t not in vocab]
    special = [t for t in model_cfg.add_special_tokens if t not in vocab]
    if not plain and not special:
        return None
    if plain:
        tokenizer.add_tokens(plain, special_tokens=False)
    if special:
        tokenizer.add_special_tokens(
            {"extra_special_tokens": special}, replace_extra_special_tokens=False
        )
    new_ids = tuple(sorted(tokenizer.convert_tokens_to_ids([*plain, *special])))
    return AddedTokens(new_ids=new_ids, known=known, size=len(tokenizer))


def configured_tokens(model_dir: Path, model_cfg: ModelConfig) -> AddedTokens | None:
    """`add_configured_tokens` on a fresh copy of `model_dir`'s tokenizer: what the tokenizer
    the data was encoded with holds (each process asks once; nothing when no tokens are set)."""
    if not model_cfg.add_tokens and not model_cfg.add_special_tokens:
        return None
    return _configured_tokens(
        str(Path(model_dir).resolve()),
        tuple(model_cfg.add_tokens),
        tuple(model_cfg.add_special_tokens),
        model_cfg.trust_remote_code,
    )


@functools.lru_cache(maxsize=4)
def _configured_tokens(model_dir: str, plain, special, trust_remote_code: bool):
    from keel.models.loading import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir), trust_remote_code=trust_remote_code)
    asked = ModelConfig(path=model_dir, add_tokens=list(plain), add_special_tokens=list(special))
    return add_configured_tokens(tokenizer, asked)


def embedding_rows(model: nn.Module) -> int:
    return model.get_input_embeddings().weight.shape[0]


def grow_vocabulary(model: nn.Module, added: AddedTokens | None, log: Log) -> bool:
    """Give the Hugging Face `model`, on the meta device, a row for every token of the
    grown tokenizer (the loader starts the new rows at the mean: keel.models.materialize);
    True when it has added tokens to learn (rows of theirs to train)."""
    if added is None:
        return False
    rows = embedding_rows(model)
    if added.size > rows:
        model.resize_token_embeddings(added.size, mean_resizing=False)
        log(
            f"tokenizer: {added.describe()}; the embeddings grow from {rows} to "
            f"{added.size} rows, new ones starting at the mean of the known rows"
        )
    else:
        log(
            f"tokenizer: {added.describe()}; their rows of the {rows} embedding rows start "
            f"at the mean of the known rows"
        )
    return True


def embedding_names(model: nn.Module) -> list[str]:
    """Module names of the input embeddings and the output layer (one when tied)."""
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = []
    for name, module in model.named_modules():
        if any(module is layer for layer in layers if layer is not None) and name not in names:
            names.append(name)
    return names


def with_trained_embeddings(model: nn.Module, method: MethodConfig, log: Log) -> MethodConfig:
    """`method` with the input embeddings and the output layer trained in full, as added
    tokens need (their rows start at the mean): an adapter's modules_to_save (LoRA, OFT),
    freeze's trainable_modules; full fine-tuning trains them already."""
    if method.uses_adapter:
        section, field = method.adapter_key.split(".")[1], "modules_to_save"
    elif method.type == "freeze":
        section, field = "freeze", "trainable_modules"
    else:
        return method
    settings = getattr(method, section)
    listed = getattr(settings, field)
    short = [name.rsplit(".", 1)[-1] for name in embedding_names(model)]
    more = [name for name in short if name not in listed]
    if not more:
        return method
    log(f"added tokens: {', '.join(more)} train in full (method.{section}.{field})")
    return replace(method, **{section: replace(settings, **{field: [*listed, *more]})})


def mean_start(stored: torch.Tensor, rows: int, added: AddedTokens) -> torch.Tensor:
    """The embedding matrix `stored` ([checkpoint rows, hidden]) at `rows` rows: the added
    tokens' rows, and any past the checkpoint's, set to the mean of the rows of known
    tokens (computed in fp32, stored in `stored`'s dtype)."""
    have = stored.shape[0]
    known = min(added.known, have)
    mean = stored[:known].float().mean(dim=0).to(stored.dtype)
    grown = torch.empty((rows, *stored.shape[1:]), dtype=stored.dtype)
    grown[:have] = stored[:rows]
    fresh = [i for i in added.new_ids if i < min(have, rows)] + list(range(have, rows))
    if fresh:
        grown[fresh] = mean
    return grown


def start_new_rows(model: nn.Module, old_rows: int, added: AddedTokens) -> None:
    """On a loaded model grown from `old_rows`: every new row starts at the mean."""
    with torch.no_grad():
        for layer in _distinct_weights(model):
            weight = layer.weight
            weight.copy_(mean_start(weight[:old_rows], weight.shape[0], added))


def fit_vocabulary(model: nn.Module, tokenizer, log: Log) -> None:
    """Grow a loaded base to the tokenizer trained with it (a run that added tokens saves
    it beside its adapter), so the adapter's embeddings fit; the rows an adapter does not
    hold start at the mean, as they did in training."""
    rows, size = embedding_rows(model), len(tokenizer)
    if size <= rows:
        return
    known = AddedTokens(new_ids=(), known=rows, size=size)
    model.resize_token_embeddings(size, mean_resizing=False)
    start_new_rows(model, rows, known)
    log(f"the tokenizer has {size} tokens: the base's embeddings grow from {rows} rows")


def _distinct_weights(model: nn.Module) -> list[nn.Module]:
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    distinct = []
    for layer in layers:
        if layer is not None and all(layer.weight is not d.weight for d in distinct):
            distinct.append(layer)
    return distinct
