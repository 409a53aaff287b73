"""What a model holds, counted on the meta device: every tensor, its FSDP unit, what trains.

The architecture comes from `config.json` alone (keel.plan.architecture). The model is
built on the meta device and the training method applied there, exactly as training
builds it (keel.models), so the counts are the real module tree's, not a formula's. A
vision-language model's tower and projector tensors carry their part and are REPLICATED: in
no FSDP unit, whole on every rank (keel.plan.vision).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from keel.config.schema import MethodConfig, QloraConfig, VisionConfig
from keel.plan.vision import LANGUAGE, PROJECTOR, TOWER
from keel.precision import Precision
from keel.quant.layout import nf4_bytes, quantizable

ROOT = -1  # unit index of the parameters left to the root FSDP unit
# "unit" of a vision tower's and projector's tensors: in no FSDP unit, whole on every rank
# (keel.plan.vision)
REPLICATED = -2

# Methods the plan weighs, in the order alternatives are suggested. QLoRA's census is
# LoRA's with the frozen linear weights of the decoder layers in NF4 (`TensorInfo.nf4`);
# it comes last: the lightest, but it changes the numerics.
METHODS = ("full", "lora", "freeze", "qlora")
# Methods whose trained weights are a PEFT adapter on a frozen base (a reference model is
# the base with the adapter off, not a copy)
ADAPTER_METHODS = ("lora", "qlora", "oft")


@dataclass(frozen=True)
class TensorInfo:
    """One parameter (tied weights once) or buffer."""

    shape: tuple[int, ...]
    itemsize: int  # bytes per element
    trainable: bool
    unit: int  # FSDP unit index (ROOT for the root); buffers are never sharded
    buffer: bool = False
    # QLoRA's frozen linear weights: NF4 where keel.quant.layout.quantizable (over the
    # ranks that split it), else kept in the compute dtype, whose size `itemsize` is then
    nf4: bool = False
    part: str = LANGUAGE  # LANGUAGE, or a vision-language model's TOWER or PROJECTOR
    # a weight matrix train.optimizer muon steps by Muon (keel.models.trainable.muon_weights)
    matrix: bool = False

    @property
    def replicated(self) -> bool:
        """Whole on every rank under every strategy (a vision tower or projector)."""
        return self.unit == REPLICATED

    @property
    def nbytes(self) -> int:
        if self.nf4 and quantizable(*self.shape):
            return nf4_bytes(*self.shape, self.itemsize)
        return math.prod(self.shape) * self.itemsize

    def shard_bytes(self, world: int, rank: int = 0, *, padded: bool = True) -> int:
        """Bytes rank `rank` holds of it under FSDP2 on `world` ranks.

        FSDP2 splits dim 0 into chunks of ceil(rows / world) (torch.chunk), so the last
        ranks may hold fewer rows or none. Parameters and gradients are stored padded to a
        full chunk; optimizer state (zeros_like of the unpadded local shard) is not. An NF4
        weight splits into equal shards (keel.quant.layout).
        """
        if self.buffer or self.replicated or not self.shape:
            return self.nbytes
        if self.nf4 and quantizable(*self.shape, world):
            return nf4_bytes(*self.shape, self.itemsize, world)
        rows = self.shape[0]
        chunk = -(-rows // world)
        held = chunk if padded else max(0, min(chunk, rows - rank * chunk))
        return held * math.prod(self.shape[1:]) * self.itemsize


@dataclass(frozen=True)
class LinearInfo:
    """A linear layer in a decoder block, as the activation formula needs it."""

    name: str  # short name: q_proj, down_proj, ...
    in_features: int
    weight_numel: int  # including the bias
    trainable: bool  # its own weight trains (full, freeze)
    lora_rank: int = 0  # > 0: wrapped by LoRA
    lora_dropout: float = 0.0
    lora_itemsize: int = 4  # the adapter weights' (PEFT keeps them in fp32)
    lora_numel: int = 0  # elements of lora_A and lora_B (and a DoRA magnitude)
    dora_features: int = 0  # > 0: DoRA, with this many output features (magnitudes)
    oft_block: int = 0  # > 0: wrapped by OFT, with rotation blocks of this size
    oft_itemsize: int = 4  # the rotations' parameters' (PEFT keeps them in fp32)
    oft_exact: bool = False  # the exact Cayley transform (a solve), not its Neumann series


@dataclass(frozen=True)
class LayerInfo:
    """One decoder block: its linears and whether its norms train."""

    linears: tuple[LinearInfo, ...]
    norm_trainable: tuple[bool, ...]
    has_trainable: bool
    experts: ExpertsInfo | None = None  # a mixture-of-experts block's routed experts
    # what each norm normalises: "h" the hidden state, "q" or "kv" the attention heads
    # (Qwen3's and OLMo 2's per-head q_norm and k_norm); all "h" when empty
    norm_inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertsInfo:
    """A block's routed experts, fused as transformers 5 holds them: one [experts, ...]
    parameter per projection (gate_up_proj, down_proj), and the router beside them."""

    count: int
    width: int  # each expert's intermediate size
    weight_numel: int  # all the experts' weights
    trainable: bool  # the experts' weights train
    router_trainable: bool
    # QLoRA's quantize_experts: bytes per value the NF4 experts dequantise to while their
    # block runs, which backward recomputes (it keeps its inputs only); 0: not NF4
    nf4_itemsize: int = 0
    # LoRA on the experts (method.lora.target_parameters): its weights' elements; 0: none
    lora_numel: int = 0


@dataclass
class Census:
    """One method applied to one architecture: what each rank would hold and train."""

    method: str
    tensors: list[TensorInfo]
    layers: list[LayerInfo]
    embeddings_trainable: bool
    head_trainable: bool  # the output layer's weight trains (tied or not)
    final_norm_trainable: bool
    param_itemsize: int  # bytes per element of the model's weights as trained
    # a vision-language model's projector, per image token: its linears' inputs and hidden
    # outputs (keel.plan.vision); 0 for a text model
    projector_width: int = 0
    # method.qat's scheme and group size (the decoder layers' linears train rounded), or None
    qat: tuple[str, int] | None = None
    units: int = field(init=False)

    def __post_init__(self):
        self.units = 1 + max((t.unit for t in self.tensors), default=-1)

    @property
    def params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors if not t.buffer)

    @property
    def trainable_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors if t.trainable)

    def part_params(self, part: str, *, trainable_only: bool = False) -> int:
        """Parameters of one part (TOWER, PROJECTOR or LANGUAGE)."""
        return sum(
            math.prod(t.shape)
            for t in self.tensors
            if t.part == part and not t.buffer and (t.trainable or not trainable_only)
        )

    @property
    def is_vision(self) -> bool:
        return any(t.part != LANGUAGE for t in self.tensors)

    def with_frozen_itemsize(self, itemsize: int) -> Census:
        """This census with frozen fp32 weights stored in `itemsize` bytes: model.dtype
        bfloat16 under LoRA (PEFT keeps the adapters in fp32)."""
        tensors = [
            replace(t, itemsize=itemsize)
            if not (t.trainable or t.buffer or t.nf4) and t.itemsize == 4
            else t
            for t in self.tensors
        ]
        frozen_embeddings = not self.embeddings_trainable
        return replace(
            self,
            tensors=tensors,
            param_itemsize=itemsize if frozen_embeddings else self.param_itemsize,
        )

    def unit_gathered_bytes(self, unit: int, itemsize: int, world: int) -> int:
        """Bytes of `unit`'s weights gathered by FSDP2 on `world` ranks at `itemsize`;
        NF4 weights gather their packed bytes (keel.quant.nf4)."""
        total = 0
        for t in self.tensors:
            if t.unit != unit or t.buffer:
                continue
            if t.nf4 and quantizable(*t.shape, world):
                total += nf4_bytes(*t.shape, t.itemsize)
            else:
                total += math.prod(t.shape) * itemsize
        return total

    def unit_numel(self, unit: int, *, trainable_only: bool = False) -> int:
        return sum(
            math.prod(t.shape)
            for t in self.tensors
            if t.unit == unit and not t.buffer and (t.trainable or not trainable_only)
        )


def take_census(
    base: nn.Module,
    method: MethodConfig,
    *,
    copy_first: bool = True,
    precision: Precision,
    log: Callable[[str], None] = lambda _m: None,
    vision: VisionConfig | None = None,
) -> Census:
    """Apply `method` to (a copy of) the meta model `base` and count what it holds.

    `precision` (resolved train.precision) sets QLoRA's compute dtype when
    method.qlora.compute_dtype is auto. `vision` (model.vision) says whether a
    vision-language model's tower and projector train, as in training.
    """
    from keel.models import apply_method

    model = copy.deepcopy(base) if copy_first else base
    # PEFT builds adapter layers on the default device, then moves them to the base
    # layer's: with meta as the default nothing is allocated (a 72B model's 0.2B LoRA
    # weights would otherwise be created and initialised in RAM first).
    with torch.device("meta"):
        model = apply_method(model, method, log=log, vision=vision)
    census = _count(model, method.type)
    if method.qat.scheme != "none" and not method.uses_adapter:  # the parameters are the same
        census = replace(census, qat=(method.qat.scheme, method.qat.group_size))
    if method.type == "qlora":
        itemsize = qlora_compute_itemsize(method, precision)
        census = _with_nf4(census, model, method.qlora, itemsize)
    return census


def qlora_compute_itemsize(method: MethodConfig, precision: Precision) -> int:
    """Bytes per element of QLoRA's compute dtype (what NF4 weights dequantise to, and
    what the weights NF4 cannot hold are kept in): method.qlora.compute_dtype, or with
    auto the training precision's (2 under bf16/fp16, else 4)."""
    named = {"float32": 4, "bfloat16": 2, "float16": 2}
    if method.qlora.compute_dtype != "auto":
        return named[method.qlora.compute_dtype]
    return precision.compute_itemsize


def _with_nf4(census: Census, model: nn.Module, qlora: QloraConfig, compute_itemsize: int):
    """QLoRA: the frozen nn.Linear weights inside the decoder layers (LoRA's base layers and
    the linears LoRA does not target; not the embeddings or the output layer) in NF4, as
    keel.quant stores them; with quantize_experts also the fused [experts, out, in]
    weights, held as [experts * out, in] (keel.models.qlora)."""
    from keel.models.trainable import decoder_layers

    get_base = getattr(model, "get_base_model", None)
    lm = get_base() if callable(get_base) else model
    frozen = {
        id(module.weight)
        for module in decoder_layers(lm).modules()
        if type(module) is nn.Linear and not module.weight.requires_grad
    }
    experts = set()
    if qlora.quantize_experts and qlora.quant_backend == "torchao":
        experts = {
            id(p) for p in decoder_layers(lm).parameters() if p.dim() == 3 and not p.requires_grad
        }
    params = list(model.parameters())  # the order _count lists them in
    tensors = [
        replace(t, itemsize=compute_itemsize, nf4=True, shape=_rows(t.shape))
        if id(p) in frozen | experts
        else t
        for t, p in zip(census.tensors, params)
    ]
    layers = census.layers
    if experts:
        layers = [
            replace(layer, experts=replace(layer.experts, nf4_itemsize=compute_itemsize))
            if layer.experts is not None
            else layer
            for layer in layers
        ]
    return replace(census, tensors=tensors + census.tensors[len(params) :], layers=layers)


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """A weight as NF4 holds it: [everything but the last dimension, the last]."""
    return math.prod(shape[:-1]), shape[-1]


def method_variants(method: MethodConfig) -> list[MethodConfig]:
    """The configured method first, then the others (with the configured sub-settings);
    with method.qat only full and freeze, the methods QAT trains."""
    others = [m for m in METHODS if m != method.type]
    if method.qat.scheme != "none":
        others = [m for m in others if m in ("full", "freeze")]
    return [method, *(replace(method, type=m) for m in others)]


def _count(model: nn.Module, method: str) -> Census:
    from keel.models.trainable import decoder_layers, muon_weights

    get_base = getattr(model, "get_base_model", None)
    lm = get_base() if callable(get_base) else model  # the *ForCausalLM inside PEFT
    parts, projector_width = _vision_parts(lm)
    layers = list(decoder_layers(lm))
    units: dict[int, int] = {}
    embeddings, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    offset = 0
    if embeddings.weight is not head.weight:  # untied: its own unit (model_setup._shard)
        units.update({id(p): 0 for p in embeddings.parameters()})
        offset = 1
    for index, layer in enumerate(layers):
        units.update({id(p): index + offset for p in layer.parameters()})
    units.update({key: REPLICATED for key in parts})
    matrices = muon_weights(model)
    tensors = [
        TensorInfo(
            tuple(p.shape),
            p.element_size(),
            p.requires_grad,
            units.get(id(p), ROOT),
            part=parts.get(id(p), LANGUAGE),
            matrix=id(p) in matrices,
        )
        for p in model.parameters()
    ]
    tensors += [
        TensorInfo(
            tuple(b.shape),
            b.element_size(),
            False,
            units.get(id(b), ROOT),
            buffer=True,
            part=parts.get(id(b), LANGUAGE),
        )
        for b in model.buffers()
    ]
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    final_norm = getattr(decoder, "norm", None)
    return Census(
        method=method,
        tensors=tensors,
        layers=[_layer_info(x) for x in layers],
        embeddings_trainable=embeddings.weight.requires_grad,
        head_trainable=head.weight.requires_grad,
        final_norm_trainable=any(p.requires_grad for p in final_norm.parameters())
        if final_norm is not None
        else False,
        param_itemsize=embeddings.weight.element_size(),
        projector_width=projector_width,
    )


def _vision_parts(model: nn.Module) -> tuple[dict[int, str], int]:
    """For a vision-language model (keel.models.vision's family of its config): the part
    (TOWER or PROJECTOR) of each of its vision tensors by id, and the projector's width per
    image token (its linears' inputs and all but the last one's outputs); ({}, 0) else."""
    from keel.models.vision import family_of
    from keel.models.vision.family import module_or_parameter

    family = family_of(model.config)
    if family is None:
        return {}, 0
    parts: dict[int, str] = {}
    for part, paths in ((TOWER, family.tower), (PROJECTOR, family.projector)):
        for path in paths:  # the projector last: Qwen2-VL's lives inside its tower
            found = module_or_parameter(model, path)  # a module, or a bare parameter
            if isinstance(found, nn.Parameter):
                tensors = [found]
            else:
                tensors = [*found.parameters(), *found.buffers()]
            for tensor in tensors:
                parts[id(tensor)] = part
    modules = [module_or_parameter(model, path) for path in family.projector]
    linears = [
        m
        for module in modules
        if isinstance(module, nn.Module)
        for m in module.modules()
        if isinstance(m, nn.Linear)
    ]
    width = sum(m.in_features for m in linears) + sum(m.out_features for m in linears[:-1])
    return parts, width


def _layer_info(layer: nn.Module) -> LayerInfo:
    linears, norms = [], []
    for name, module in layer.named_modules():
        short = name.rsplit(".", 1)[-1]
        if _adapts_a_parameter(module):  # LoRA on fused experts: counted with them
            continue
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a PEFT LoRA layer
            linears.append(_adapted(short, module, **_lora_fields(module)))
        elif hasattr(module, "base_layer") and hasattr(module, "oft_R"):  # a PEFT OFT layer
            rotation = module.oft_R["default"]
            oft = {
                "oft_block": rotation.block_size,
                "oft_itemsize": rotation.weight.element_size(),
                "oft_exact": not rotation.use_cayley_neumann,
            }
            linears.append(_adapted(short, module, **oft))
        elif isinstance(module, nn.Linear) and not _inside_lora(name):
            linears.append(LinearInfo(short, module.in_features, _numel(module), _trains(module)))
        elif (
            "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None
        ):
            norms.append((short, module.weight.numel(), module.weight.requires_grad))
    widest = max((numel for _, numel, _ in norms), default=0)
    return LayerInfo(
        linears=tuple(linears),
        norm_trainable=tuple(trains for _, _, trains in norms),
        norm_inputs=tuple(
            "h" if numel == widest else "q" if short.startswith("q") else "kv"
            for short, numel, _ in norms
        ),
        has_trainable=any(p.requires_grad for p in layer.parameters()),
        experts=_experts_info(layer),
    )


def _experts_info(layer: nn.Module) -> ExpertsInfo | None:
    """The block's fused routed experts (a module holding 3-D gate_up_proj and down_proj
    parameters), None for a dense block. The router is the experts' sibling that holds a
    weight of [experts, hidden] (Qwen-MoE's and Mixtral's `gate`). LoRA on the experts
    (PEFT's ParamWrapper, one per adapted parameter) wraps the module, as its base_layer."""
    for name, module in layer.named_modules():
        down = vars(module).get("_parameters", {}).get("down_proj")
        if not isinstance(down, nn.Parameter) or down.dim() != 3:
            continue
        count, x, y = down.shape  # [E, hidden, width], or [E, width, hidden] (gpt-oss)
        gate_up = getattr(module, "gate_up_proj", None)  # [E, 2 width, hidden] or transposed
        fused = tuple(gate_up.shape[1:]) if gate_up is not None else ()
        width = x if 2 * x in fused and y in fused and 2 * y not in fused else y
        outer = name.split(".base_layer")[0]  # the outermost wrapper, or the module itself
        parent = layer.get_submodule(outer.rpartition(".")[0]) if "." in outer else layer
        wrapper = layer.get_submodule(outer) if outer else layer
        router = [
            p
            for child in parent.children()
            if child is not wrapper
            for p in child.parameters(recurse=False)
            if p.dim() == 2 and p.shape[0] == count
        ]
        lora = [p for n, p in wrapper.named_parameters() if ".lora_" in f".{n}"]
        return ExpertsInfo(
            count=count,
            width=width,
            weight_numel=_numel(module),
            trainable=any(p.requires_grad for p in module.parameters()),
            router_trainable=any(p.requires_grad for p in router),
            lora_numel=sum(p.numel() for p in lora),
        )
    return None


def _adapts_a_parameter(module: nn.Module) -> bool:
    """PEFT's LoRA on a parameter (a fused experts weight), not on a Linear module."""
    return type(module).__name__ == "ParamWrapper"


def _adapted(short: str, module: nn.Module, **adapter) -> LinearInfo:
    """A PEFT-wrapped linear: its base layer's sizes, and the adapter's fields."""
    base = module.base_layer
    return LinearInfo(short, base.in_features, _numel(base), _trains(base), **adapter)


def _lora_fields(module: nn.Module) -> dict:
    dropout = module.lora_dropout["default"]
    magnitudes = getattr(module, "lora_magnitude_vector", None) or {}
    magnitude = magnitudes["default"] if "default" in magnitudes else None
    return {
        "lora_rank": module.r["default"],
        "lora_dropout": getattr(dropout, "p", 0.0),
        "lora_itemsize": module.lora_A["default"].weight.element_size(),
        "lora_numel": _numel(module.lora_A["default"])
        + _numel(module.lora_B["default"])
        + (_numel(magnitude) if magnitude is not None else 0),
        "dora_features": _numel(magnitude) if magnitude is not None else 0,
    }


def _inside_lora(name: str) -> bool:
    return any(part in name.split(".") for part in ("base_layer", "lora_A", "lora_B", "oft_R"))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _trains(module: nn.Module) -> bool:
    return module.weight.requires_grad
