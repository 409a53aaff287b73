"""Build a model with no memory behind it, then fill it tensor by tensor from safetensors.

Training builds every model this way: on the meta device first (so sharding can be
applied before any weight exists), then each process allocates what it holds and copies
in only its part of each checkpoint tensor. A sharded process therefore never holds more
than its shards plus one full tensor, and one and many processes load identical weights.

New parameters that are not in the checkpoint (LoRA adapters) are initialised from
(seed, parameter name), so their values do not depend on the number of processes.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from keel.errors import ModelError
from keel.models.adapter_weights import DORA_MAGNITUDE, AdapterWeights
from keel.models.attention import auto_attention
from keel.models.checkpoint_names import stored_names
from keel.models.checkpoint_reader import CheckpointReader
from keel.models.loading import model_class
from keel.models.mxfp4 import is_mxfp4, mxfp4_weights
from keel.models.vocabulary import AddedTokens, embedding_names, mean_start
from keel.models.weight_split import SPLITS, SplitStart, fill_split
from keel.quant.nf4 import is_nf4

_PEFT_PREFIX = "base_model.model."
# torch.nn.utils.parametrize keeps `experts.gate_up_proj` as
# `experts.parametrizations.gate_up_proj.original` (QLoRA's NF4 experts)
_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")
_PARAMETRIZED = re.compile(r"\.parametrizations\.([^.]+)\.original$")


def build_empty_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
) -> nn.Module:
    """The model of `model_dir` on the meta device: an `AutoModelForCausalLM`, or an
    `AutoModelForImageTextToText` for a vision-language family (keel.models.loading.model_class).

    `attn_implementation` auto: see keel.models.attention.auto_attention; the choice is
    the built model's `config._attn_implementation`."""
    from transformers import AutoConfig

    source = str(Path(model_dir).expanduser().resolve())
    kind = "causal-LM"
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        auto_class, kind = model_class(config)
        if attn_implementation == "auto":
            attn_implementation = auto_attention(config)
        with torch.device("meta"):
            model = auto_class.from_config(
                config,
                dtype=dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
    except (OSError, ValueError, ImportError) as e:
        hint = ""
        if "does not support an attention implementation" in str(e):
            hint = " (set model.attn_implementation: eager for this architecture)"
        raise ModelError(f"cannot build a {kind} model from {source}{hint}: {e}") from e
    if is_mxfp4(model.config):  # keel dequantizes the experts while loading (keel.models.mxfp4)
        del model.config.quantization_config
    # PEFT copies name_or_path into adapter_config.json as the base model: keep it absolute.
    model.name_or_path = source
    model.config._name_or_path = source
    _check_checkpoint_names(model, Path(source))
    _load_generation_config(model, Path(source))
    return model


def _check_checkpoint_names(model: nn.Module, model_dir: Path) -> None:
    """Refuse, before anything is allocated, a checkpoint keel cannot copy tensor by tensor.

    fill_weights reads each tensor under the model's own parameter name, or the older name
    transformers renames into it (keel.models.checkpoint_names). transformers also fuses
    some families' tensors while loading (e.g. per-expert MoE weights into one
    [experts, ...] tensor); keel's sharded loader does not, so those checkpoints are refused
    here with the reason rather than failing on the first missing name.
    """
    reader = CheckpointReader(model_dir)
    try:
        key_of = stored_key_lookup(model, reader)
        missing = [
            name for name, _ in materialized_tensors(model) if reader.shape(key_of(name)) is None
        ]
    finally:
        reader.close()
    if missing:
        raise ModelError(
            f"{model_dir}: {len(missing)} of the model's tensors are not in the "
            f"checkpoint (e.g. {', '.join(missing[:3])}); the checkpoint does not match the "
            f"architecture in its config.json"
        )


def _load_generation_config(model: nn.Module, model_dir: Path) -> None:
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(model_dir))


def checkpoint_key(param_name: str) -> str:
    """The model's own name of a (possibly PEFT-wrapped, possibly prefixed) parameter: its
    name in the HF files, unless transformers renames it while loading (`stored_key_lookup`).

    PEFT's modules_to_save (a trainable projector beside LoRA) keeps the original module and
    a trained copy under `original_module.` and `modules_to_save.default.`: both start from
    the checkpoint's tensor."""
    # a weight LoRA wraps twice (two parameters of one experts module) sits two base_layers in
    name = _BASE_LAYERS.sub(".", param_name.removeprefix(_PEFT_PREFIX))
    name = name.replace(".original_module.", ".").replace(".modules_to_save.default.", ".")
    return _PARAMETRIZED.sub(r".\1", name)  # a parametrized weight's stored original


def stored_key_lookup(model: nn.Module, reader: CheckpointReader) -> Callable[[str], str]:
    """parameter name -> the key of its tensor in `reader`'s files: `checkpoint_key`, or the
    older name transformers renames into it (keel.models.checkpoint_names). Fused expert
    tensors keep their own names, which `reader` then stacks from the per-expert ones."""
    get_base = getattr(model, "get_base_model", None)  # PEFT: the Hugging Face model inside
    hf_model = get_base() if callable(get_base) else model
    names = [checkpoint_key(name) for name, _ in materialized_tensors(model)]
    found = stored_names(hf_model, names, reader.keys())
    reader.add_stacked(found.stacked)  # a fused expert tensor is read under its own name
    reader.add_stacked(mxfp4_weights(names, reader.keys()))  # gpt-oss: dequantized

    def key_of(param_name: str) -> str:
        own = checkpoint_key(param_name)
        return found.renamed.get(own, own)

    return key_of


def initial_value(
    name: str, shape: torch.Size, seed: int, lora_init: str = "default"
) -> torch.Tensor:
    """Deterministic fp32 initial value of a new (adapter) parameter, as PEFT initialises it.

    lora_A: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), or
    N(0, 1/r) under `lora_init` gaussian (pissa and olora replace A and B later:
    keel.models.weight_split);
    lora_B: zeros (so training starts from the base model exactly); for embeddings the
    roles swap (A zeros, B standard normal). OFT's oft_R: zeros (the identity rotation).
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if ".lora_embedding_A." in name:
        return torch.zeros(shape)
    if ".lora_embedding_B." in name:
        return torch.randn(shape, generator=generator)
    if ".lora_A." in name and lora_init == "gaussian":
        return torch.empty(shape).normal_(0.0, 1 / shape[0], generator=generator)
    if ".lora_A." in name:
        bound = 1 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    if ".lora_B." in name or ".oft_R." in name:  # OFT: a zero skew matrix, no rotation
        return torch.zeros(shape)
    raise ModelError(
        f"parameter {name} is neither in the checkpoint nor a LoRA or OFT adapter "
        f"weight; keel does not know how to initialise it"
    )


def fill_dora_magnitudes(model: nn.Module, local: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Start each DoRA magnitude at the norm of its layer's weight rows, as PEFT does, so
    that training starts from the base model exactly (LoRA's B is zero). Each process
    computes the rows it holds: FSDP2 splits a weight and its magnitude by the same rows.
    A 4-bit base (QLoRA with bitsandbytes; keel.config.validate refuses torchao's NF4 with
    DoRA) gives the norms of the weights its matmuls use."""
    from peft.utils.integrations import dequantize_module_weight

    for module in model.modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes:
            continue
        weight = local(module.get_base_layer().weight)
        if type(weight).__name__ == "Params4bit":  # bitsandbytes: its whole module
            weight = dequantize_module_weight(module.get_base_layer())
        norms = torch.linalg.norm(weight.float(), dim=1)
        for magnitude in magnitudes.values():
            local(magnitude.weight).copy_(norms)


def materialized_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and persistent buffer, shared tensors once."""
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *_persistent_buffers(model)]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def allocate(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)`, keeping tied parameters (embeddings = output layer) tied.

    to_empty gives every module its own new tensor, which would silently untie them.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for shared in owners.values():
        first_module, first_name = shared[0]
        for module, name in shared[1:]:
            setattr(module, name, getattr(first_module, first_name))


def init_computed_buffers(lm: nn.Module, device: torch.device | None = None) -> None:
    """Recompute non-persistent buffers (rotary frequencies) that `to_empty` left garbage,
    and with `device`, put every buffer there: computed buffers live where the compute is
    (an offloaded FSDP model's parameters are in CPU memory, its rotary tables must not be).

    Each buffer is computed by the innermost Hugging Face model holding it, with that model's
    config: a vision-language model's tower (e.g. CLIP's position ids) is a model of its own,
    which the outer model's initialiser does not know."""
    from transformers import PreTrainedModel

    initializers = {"": lm._init_weights}  # module name -> the initialiser that covers it
    for name, module in lm.named_modules():
        if name:
            inner = isinstance(module, PreTrainedModel)
            initializers[name] = (
                module._init_weights if inner else initializers[name.rpartition(".")[0]]
            )
        if _refill_oft_indices(module):
            continue
        if module._non_persistent_buffers_set:
            initializers[name](module)
    if device is None:
        return
    for module in lm.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def _refill_oft_indices(module: nn.Module) -> bool:
    """PEFT's OFT rotation module keeps the indices of a block's upper triangle as
    non-persistent buffers (rows, cols), which no Hugging Face initialiser knows: compute
    them again. True when `module` is one."""
    if "peft" not in sys.modules:  # no adapter was applied
        return False
    from peft.tuners.oft.layer import OFTRotationModule

    if not isinstance(module, OFTRotationModule):
        return False
    rows, cols = torch.triu_indices(module.block_size, module.block_size, 1)
    module._buffers["rows"], module._buffers["cols"] = rows, cols
    return True


def _fill_nf4(tensor, reader: CheckpointReader, key: str, region) -> None:
    """Quantise this process's rows of `key` into the NF4 `tensor`. A fused [experts, out,
    in] weight is held as [experts * out, in] rows (keel.quant.nf4.StoredAs)."""
    from keel.quant.nf4 import absmax_mean_of, fill_nf4

    *outer, cols = reader.shape(key)
    rows = math.prod(outer)
    if len(outer) == 1:
        mean = absmax_mean_of(lambda part: reader.get(key, (part,)), rows, cols, tensor.dtype)
        value = reader.get(key, region)
    else:  # experts are read whole (one tensor at a time), then cut into rows
        whole = reader.get(key).reshape(rows, cols)
        mean = absmax_mean_of(whole.__getitem__, rows, cols, tensor.dtype)
        value = whole if region is None else whole[region]
    fill_nf4(tensor, value, mean)


@dataclass(frozen=True)
class Starts:
    """Where the weights the base checkpoint does not hold (as they are) start from."""

    seed: int  # new adapter weights: `initial_value(name, shape, seed)`
    adapter_dir: Path | None = None  # model.adapter: its saved weights instead
    added: AddedTokens | None = None  # added tokens' embedding rows: the known rows' mean
    lora_init: str = "default"  # method.lora.init (pissa, olora: keel.models.weight_split)
    pissa_iters: int = 16


def fill_weights(
    model: nn.Module,
    model_dir: Path,
    starts: Starts,
    *,
    region_of: Callable[[torch.Tensor], tuple[slice, ...] | None],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> list[str]:
    """Copy this process's part of each checkpoint tensor into the allocated model.

    `region_of(param)` says which part of the full tensor this process holds (None: all)
    and `local(param)` gives the tensor to write into. Only that region is read from disk.
    With `starts.adapter_dir` (model.adapter) the adapter's weights (LoRA and modules
    trained in full) come from its folder, every one of them; else parameters missing from
    the checkpoint are initialised by `initial_value` (LoRA). Embedding rows of added
    tokens start at the mean (keel.models.vocabulary). Returns the initialised names.
    """
    reader = CheckpointReader(Path(model_dir))
    adapter_dir, seed = starts.adapter_dir, starts.seed
    adapter = AdapterWeights(Path(adapter_dir)) if adapter_dir is not None else None
    grown = _embedding_keys(model) if starts.added is not None else set()
    initialised: list[str] = []
    try:
        key_of = stored_key_lookup(model, reader)
        with torch.no_grad():
            for name, tensor in materialized_tensors(model):
                if adapter is not None and adapter.fill(name, tensor, region_of, local):
                    continue
                if DORA_MAGNITUDE in name:  # from its base weight, once that is filled
                    initialised.append(name)
                    continue
                key = key_of(name)
                custom = getattr(
                    model.get_submodule(name.rpartition(".")[0]), "keel_load_weight", None
                )
                if custom is not None and name.endswith(".weight"):  # e.g. a bnb 4-bit base
                    custom(reader.get, key, reader.keys())
                    continue
                region = region_of(tensor)
                stored = reader.shape(key)
                if checkpoint_key(name) in grown:  # added tokens' rows: the known rows' mean
                    value = mean_start(reader.get(key), tensor.shape[0], starts.added)
                    value = value if region is None else value[region]
                elif stored is None:
                    value = initial_value(name, tensor.shape, seed, starts.lora_init)
                    value = value if region is None else value[region]
                    initialised.append(name)
                elif is_nf4(tensor) and _holds(tensor, stored):  # QLoRA: quantise these rows
                    _fill_nf4(tensor, reader, key, region)
                    continue
                elif stored != tuple(tensor.shape):
                    four_bit = reader.shape(f"{key}.quant_state.bitsandbytes__nf4") is not None
                    hint = (
                        "; the checkpoint is stored 4-bit by bitsandbytes: train it with "
                        "method.type qlora and method.qlora.quant_backend bnb"
                        if four_bit
                        else ""
                    )
                    raise ModelError(
                        f"{name}: checkpoint shape {stored} differs from the "
                        f"model's {tuple(tensor.shape)} in {model_dir}{hint}"
                    )
                else:
                    value = reader.get(key, region)
                local(tensor).copy_(value)
            if adapter is None:
                fill_dora_magnitudes(model, local)
            if adapter is None and starts.lora_init in SPLITS:
                split = SplitStart(starts.lora_init, starts.pissa_iters, seed)
                fill_split(
                    model,
                    lambda name: reader.get(key_of(name)),  # a base weight, whole
                    split,
                    region_of=region_of,
                    local=local,
                )
        if adapter is not None:
            adapter.check_all_used(model)
    finally:
        reader.close()
        if adapter is not None:
            adapter.reader.close()
    return initialised


def _holds(tensor: torch.Tensor, stored: tuple[int, ...]) -> bool:
    """Whether the NF4 `tensor` holds the stored weight: its shape, or a fused expert
    weight's [experts, out, in] as [experts * out, in]."""
    rows, cols = tensor.shape
    return stored[-1] == cols and math.prod(stored[:-1]) == rows


def _embedding_keys(model: nn.Module) -> set[str]:
    """Checkpoint keys of the input embeddings and the output layer (weight and bias)."""
    get_base = getattr(model, "get_base_model", None)  # PEFT: the Hugging Face model inside
    hf_model = get_base() if callable(get_base) else model
    names = embedding_names(hf_model)
    return {checkpoint_key(f"{name}.{part}") for name in names for part in ("weight", "bias")}
