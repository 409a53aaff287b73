"""`keel expand`: LLaMA Pro's block expansion, a model folder with N new decoder blocks.

The decoder's L layers are cut into N equal groups, and after each group's last layer a
copy of it is inserted with its output projections (attention's o_proj, the MLP's or
experts' down_proj, weights and biases) zeroed: a new block adds nothing to the residual
stream, so the expanded model computes what the original does, and training only the new
blocks (method.freeze.expanded_blocks) adds knowledge without overwriting the old layers.
This is what LLaMA-Factory's scripts/llama_pro.py writes, for every family whose blocks name
those projections so.

keel checks the result before writing it: the expanded model's logits on a probe input
equal the original's (a family whose block is not the identity with those projections
zeroed is refused). Config settings that hold one value per layer (layer_types) get the
copied layer's value at each new index; settings that name layer indices some other way
are refused, since they would silently mean other layers.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from keel import __version__
from keel.errors import ModelError
from keel.export.merge import load_base
from keel.export.partial_folder import write_folder_atomically
from keel.export.probe import probe_inputs
from keel.export.write import DEFAULT_MAX_SHARD_SIZE, check_out, write_model_folder
from keel.models.bundled import resolve_model_path
from keel.models.loading import load_tokenizer
from keel.models.trainable import decoder_layers, expanded_block_indices

Log = Callable[[str], None]
EXPAND_FILE = "keel_expand.json"
_ZEROED = ("o_proj", "down_proj")  # a block's output projections, LLaMA Pro's choice
# text-config settings that name layers by index (not one value per layer): an expansion
# would silently move them onto other layers
_INDEXED = ("mlp_only_layers", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
            "interleave_moe_layer_step", "no_rope_layer_interval")  # fmt: skip
_PROBE_TOLERANCE = 1e-5  # relative to the logits' scale: the new blocks add exact zeros


@dataclass(frozen=True, kw_only=True)
class ExpandRequest:
    """What `keel expand` was asked for."""

    model: str  # HF model dir, Hub id or bundled:NAME
    blocks: int  # new decoder blocks, one after each of `blocks` equal groups of layers
    out: Path
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    cache_dir: str | Path = "~/.cache/keel"


def expand_model(request: ExpandRequest, log: Log = print) -> Path:
    """Write `request.model` with `request.blocks` new blocks to `request.out` (built beside
    it and renamed at the end; a non-empty `out` is refused untouched); returns `out`."""
    from transformers import AutoConfig

    out = check_out(Path(request.out).expanduser())
    base_dir = resolve_model_path(request.model, request.cache_dir, log)
    text_config = AutoConfig.from_pretrained(str(base_dir)).get_text_config()
    _check_groups(text_config.num_hidden_layers, request.blocks)  # before loading a weight
    _refuse_indexed_settings(text_config)
    tokenizer = load_tokenizer(base_dir)
    model, stored_dtype = load_base(base_dir)
    probe = probe_inputs(model, base_dir, tokenizer, log)
    with torch.no_grad():
        before = model(**probe).logits
    inserted = expand_blocks(model, request.blocks)
    with torch.no_grad():
        after = model(**probe).logits
    diff = (after - before).abs().max().item()
    if diff > _PROBE_TOLERANCE * max(before.abs().max().item(), 1.0):
        raise ModelError(
            f"{type(model).__name__}: with its new blocks' {' and '.join(_ZEROED)} zeroed, the "
            f"expanded model's logits differ from the original's by {diff:.3g}: its blocks "
            f"are not the identity so; keel expand supports families whose blocks are"
        )
    model.to(stored_dtype)
    layers = len(decoder_layers(model))
    provenance = {
        "base": str(base_dir),
        "blocks_added": request.blocks,
        "inserted_layers": inserted,
        "layers": layers,
        "probe_max_abs_logit_diff": diff,
        "keel_version": __version__,
    }

    def write(folder: Path) -> None:
        write_model_folder(folder, model, tokenizer, request.max_shard_size)
        (folder / EXPAND_FILE).write_text(json.dumps(provenance, indent=2) + "\n")

    write_folder_atomically(out, write, log)
    log(
        f"expanded {layers - request.blocks} to {layers} decoder layers (new: "
        f"{', '.join(map(str, inserted))}; logits unchanged, max diff {diff:.1e}) -> {out}; "
        f"train the new blocks with method.type freeze, method.freeze.trainable_layers "
        f"{request.blocks} and method.freeze.expanded_blocks true"
    )
    return out


def expand_blocks(model: torch.nn.Module, blocks: int) -> list[int]:
    """Insert `blocks` zero-output copies into the model's decoder layers, in place (its
    config follows); returns the new layers' indices."""
    layers = decoder_layers(model)
    count = len(layers)
    _check_groups(count, blocks)
    group = count // blocks
    sources = [i for i in range(count) if (i + 1) % group == 0]
    for offset, source in enumerate(sources):
        layers.insert(source + offset + 1, _zero_output_copy(layers[source + offset], source))
    for index, layer in enumerate(layers):  # the KV cache and masks read each block's index
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    _expand_config(model.config.get_text_config(), count, sources)
    return list(expanded_block_indices(len(layers), blocks))  # what expanded_blocks trains


def _check_groups(count: int, blocks: int) -> None:
    if blocks <= 0 or count % blocks:
        raise ModelError(
            f"--blocks {blocks}: the model's {count} decoder layers must split into that many "
            f"equal groups (a new block follows each); use a divisor of {count}"
        )


def _zero_output_copy(layer: torch.nn.Module, source: int) -> torch.nn.Module:
    block = copy.deepcopy(layer)
    zeroed = [
        param
        for name, param in block.named_parameters()
        if any(part in name.split(".") for part in _ZEROED)
    ]
    names = {part for name, _ in block.named_parameters() for part in name.split(".")}
    if not all(part in names for part in _ZEROED):
        raise ModelError(
            f"decoder layer {source} ({type(layer).__name__}) has no "
            f"{' and '.join(p for p in _ZEROED if p not in names)}: keel expand zeroes a new "
            f"block's {' and '.join(_ZEROED)} (Llama, Mistral, Qwen, Gemma and their kin); "
            f"this family names its output projections otherwise"
        )
    with torch.no_grad():
        for param in zeroed:
            param.zero_()
    return block


def _expand_config(text_config, count: int, sources: list[int]) -> None:
    """num_hidden_layers, and each setting of one value per layer with the copied layer's
    value at every new index."""
    text_config.num_hidden_layers = count + len(sources)
    if getattr(text_config, "max_window_layers", None) == count:  # every layer, still
        text_config.max_window_layers = count + len(sources)
    for key, value in list(vars(text_config).items()):
        if isinstance(value, list) and len(value) == count:
            expanded = []
            for index, item in enumerate(value):
                expanded.append(item)
                if index in sources:
                    expanded.append(item)
            setattr(text_config, key, expanded)


def _refuse_indexed_settings(text_config) -> None:
    found = [key for key in _INDEXED if getattr(text_config, key, None) not in (None, [], 0, 1)]
    if getattr(text_config, "use_sliding_window", False) and getattr(
        text_config, "max_window_layers", None
    ) not in (None, text_config.num_hidden_layers):
        found.append("max_window_layers")
    if found:
        raise ModelError(
            f"the model's config names layers by index ({', '.join(found)}): after an "
            f"expansion those would mean other layers; keel expand does not rewrite them"
        )
