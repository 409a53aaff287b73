"""What trains, chosen by name: the decoder layers, module names (PEFT's rule) and
parameter patterns; and method freeze, which trains what these choose."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

import torch

from keel.config.schema import FreezeConfig
from keel.errors import ModelError

Log = Callable[[str], None]
_WHERE_LAYERS = "looked at model.get_decoder().layers and model.model.layers"


def find_decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's list of transformer blocks, in order, or None where keel finds none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of transformer blocks, in order; ModelError where keel finds none."""
    layers = find_decoder_layers(model)
    if layers is None:
        raise ModelError(
            f"cannot find the decoder layers of {type(model).__name__} ({_WHERE_LAYERS}); "
            "use method.type full or lora"
        )
    return layers


def matches(name: str, entry: str) -> bool:
    # PEFT's rule, used for both freeze and LoRA: the exact qualified name or a dotted suffix.
    return name == entry or name.endswith("." + entry)


def unknown_names(entries: list[str], names: list[str]) -> list[str]:
    """One problem line per entry matching none of `names`, with the closest existing ones."""
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names} | set(names))
    problems = []
    for entry in entries:
        if not any(matches(n, entry) for n in names):
            close = difflib.get_close_matches(entry, suffixes, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problems.append(f"{entry!r}{hint}")
    return problems


def short_names(names: list[str]) -> str:
    # Layer indices ("0", "1", ...) are not names anyone types on their own.
    short = {n.rsplit(".", 1)[-1] for n in names}
    return ", ".join(sorted(s for s in short if not s.isdigit()))


def expanded_block_indices(layers: int, blocks: int) -> range:
    """The last layer of each of `blocks` equal groups of `layers` decoder layers: where a
    block expansion (keel expand, LLaMA Pro) put its new blocks."""
    stride = layers // blocks
    return range(stride - 1, layers, stride)


def freeze_problems(model: torch.nn.Module, freeze: FreezeConfig) -> list[str]:
    """Every reason method freeze cannot apply to `model`, each naming its key; []: it can."""
    problems = []
    layers = find_decoder_layers(model)
    if layers is None:
        problems.append(
            f"method.type = freeze trains the last decoder layers, but keel cannot find those "
            f"of {type(model).__name__} ({_WHERE_LAYERS}); use method.type full or lora"
        )
    elif freeze.expanded_blocks and (
        freeze.trainable_layers <= 0 or len(layers) % freeze.trainable_layers
    ):
        problems.append(
            f"method.freeze.expanded_blocks trains the last layer of each of trainable_layers "
            f"= {freeze.trainable_layers} equal groups, but the model's {len(layers)} decoder "
            f"layers do not split into {freeze.trainable_layers} groups; set trainable_layers "
            f"to the number of blocks the expansion added"
        )
    elif not abs(freeze.trainable_layers) <= len(layers):
        problems.append(
            f"method.freeze.trainable_layers = {freeze.trainable_layers} is outside "
            f"-{len(layers)}..{len(layers)} (the model has {len(layers)} decoder layers); set "
            f"it to at most {len(layers)} (-N: the first N), or use method.type full to train "
            f"every layer"
        )
    names = [n for n, _ in model.named_modules() if n]
    unknown = unknown_names(freeze.trainable_modules, names)
    if unknown:
        problems.append(
            f"method.freeze.trainable_modules: no module named {'; '.join(unknown)} in "
            f"{type(model).__name__}; this model has: {short_names(names)}"
        )
    problems += _pattern_problems(model, freeze.trainable_params)
    if not problems and not _freeze_trainable(model, freeze):
        problems.append(
            f"method.freeze: nothing would train (trainable_layers = "
            f"{freeze.trainable_layers}, trainable_modules = {freeze.trainable_modules} and "
            f"trainable_params = {freeze.trainable_params} choose no parameters); set "
            f"trainable_layers > 0 or list modules with weights"
        )
    return problems


def _pattern_problems(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """A pattern that is not a regular expression, or matches no parameter name, is refused:
    either would train something else than its author meant."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    problems = []
    for pattern in patterns:
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            problems.append(
                f"method.freeze.trainable_params: {pattern!r} is not a regular expression "
                f"({exc}); escape literal characters such as [ ( + with a backslash"
            )
            continue
        if not any(compiled.match(name) for name in names):
            close = difflib.get_close_matches(pattern, names, n=2, cutoff=0.3)
            problems.append(
                f"method.freeze.trainable_params: {pattern!r} matches no parameter name of "
                f"{type(model).__name__} from its start (names look like "
                f"{', '.join(close or names[:2])}); start it with .* to match anywhere in a name"
            )
    return problems


def _freeze_trainable(model: torch.nn.Module, freeze: FreezeConfig) -> list[torch.nn.Parameter]:
    """The parameters that train under `freeze` (checked by `freeze_problems` first), each
    once: a tied weight trains when any of its names is chosen."""
    layers, count = list(decoder_layers(model)), freeze.trainable_layers
    if freeze.expanded_blocks:  # LLaMA Pro: each group's last layer, the inserted block
        chosen = [layers[i] for i in expanded_block_indices(len(layers), count)]
    else:
        chosen = layers[:-count] if count < 0 else layers[len(layers) - count :]
    modules = chosen + [
        m
        for name, m in model.named_modules()
        if any(matches(name, entry) for entry in freeze.trainable_modules)
    ]
    chosen = {id(p): p for module in modules for p in module.parameters()}
    patterns = [re.compile(pattern) for pattern in freeze.trainable_params]
    for name, param in model.named_parameters(remove_duplicate=False):
        if any(pattern.match(name) for pattern in patterns):
            chosen[id(param)] = param
    return list(chosen.values())


def apply_freeze(model: torch.nn.Module, freeze: FreezeConfig, log: Log) -> None:
    """Only what `freeze` chooses trains."""
    model.requires_grad_(False)
    for param in _freeze_trainable(model, freeze):
        param.requires_grad_(True)
    if freeze.expanded_blocks:
        count = len(decoder_layers(model))
        shown = ", ".join(map(str, expanded_block_indices(count, freeze.trainable_layers)))
        log(f"freeze: the expanded blocks train (LLaMA Pro): decoder layers {shown} of {count}")
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and inputs is not None and outputs.weight is inputs.weight
    if tied and inputs.weight.requires_grad:
        log("note: lm_head and the input embeddings share one weight here, so both train")


def muon_weights(model: torch.nn.Module) -> set[int]:
    """ids of the trainable parameters train.optimizer muon steps by Muon: each trained
    matrix (2-D) outside the input embeddings and the output layer (a row per token, not a
    linear map), LoRA's A and B included, and a mixture of experts' fused [experts, rows,
    columns] weights (a matrix per expert). `model`: any module around the Hugging Face
    model (PEFT, DDP, keel's objective)."""
    names = {id(module): name for name, module in model.named_modules()}
    output_name = "lm_head"
    for module in model.modules():
        try:
            output = module.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            continue
        if isinstance(output, torch.nn.Module) and id(output) in names:
            output_name = names[id(output)].split(".")[-1]
            break
    chosen = set()
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        parts = name.split(".")
        if not param.requires_grad or isinstance(owner, torch.nn.Embedding):
            continue
        if output_name in parts:
            continue
        if param.ndim == 2 or (param.ndim == 3 and parts[-2] == "experts"):
            chosen.add(id(param))
    return chosen
