"""Checks on a LoRA adapter folder before PEFT reads it: where it is, what it holds, how big.

Adapters named over HTTP come from clients, so nothing is handed to PEFT until the folder
is known to be inside the operator's adapter root, to hold only safetensors weights (never
a pickle), and to fit the server's caps on rank and size. Each refusal is a ModelError
that says what was wrong, and the routes answer it as a 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from keel.errors import ModelError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
# PEFT initialisations that compute from (and PiSSA/OLoRA: rewrite) the base weights at
# load time; only plain initialisation keeps the shared base untouched.
PLAIN_INITS = (True, False, "gaussian")


@dataclass(frozen=True, kw_only=True)
class AdapterCaps:
    """How many adapters the server holds, and how large each may be."""

    max_adapters: int = 8
    max_rank: int = 256
    max_bytes: int = 1 << 30  # adapter_model.safetensors


@dataclass(frozen=True)
class LoraShapes:
    """The LoRA pairs an adapter file holds: module path -> (A shape, B shape)."""

    pairs: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    # the modules it trains in full beside LoRA (adapter_config.json's PEFT modules_to_save)
    in_full: tuple[str, ...] = ()
    # the shapes of the weights it holds whole (modules_to_save): parameter path -> shape
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dora: bool = False  # DoRA (use_dora): a magnitude per output feature beside each pair


def within_root(root: Path, given: str) -> Path:
    """The adapter folder `given` (relative to `root`, or absolute) with every symlink
    resolved; ModelError unless it and the files PEFT reads all lie inside `root`."""
    base = root.resolve()
    try:
        directory = (base / given).resolve()  # an absolute `given` replaces `base`
        files = [(directory / name).resolve() for name in (CONFIG_FILE, WEIGHTS_FILE)]
    except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, symlink loops
        raise ModelError(f"lora_path {given!r} is not a usable path: {e}") from None
    for path in (directory, *files):
        if not path.is_relative_to(base):
            raise ModelError(
                f"lora_path {given!r} leads outside the adapter root {root} (to {path}); "
                "only adapters inside --adapter-root can be loaded over the API"
            )
    return directory


def inspect_adapter(name: str, path: str, caps: AdapterCaps) -> LoraShapes:
    """Check the adapter folder at `path` against `caps`; return its LoRA tensor shapes."""
    directory = Path(path).expanduser()
    where = f"adapter {name!r} ({path})"
    config = _read_config(directory, where)
    _check_config(config, where, caps)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        pickled = [f for f in PICKLE_FILES if (directory / f).exists()]
        why = (
            f"holds {pickled[0]}, a pickle, which keel serve never loads (it can run code); "
            "save the adapter as safetensors (PEFT's default)"
            if pickled
            else f"has no {WEIGHTS_FILE}"
        )
        raise ModelError(f"{where}: {why}")
    size = weights.stat().st_size
    if size > caps.max_bytes:
        raise ModelError(
            f"{where}: {WEIGHTS_FILE} is {size} bytes, over this server's limit of "
            f"{caps.max_bytes} (--max-adapter-size)"
        )
    modules = config.get("modules_to_save") or []
    in_full = tuple(sorted(modules) if isinstance(modules, list) else [str(modules)])
    dora = bool(config.get("use_dora", False))
    return replace(_lora_shapes(weights, where, caps), in_full=in_full, dora=dora)


def check_against_base(shapes: LoraShapes, base, where: str) -> None:
    """Every LoRA pair fits the base module it names: A is [r, in], B is [out, r]
    (in, out: a linear layer's features, an embedding's rows and width)."""
    for module_path, (a_shape, b_shape) in shapes.pairs.items():
        try:
            module = base.get_submodule(module_path)
        except AttributeError:
            raise ModelError(
                f"{where}: names module {module_path}, which the base model does not have; "
                "was it trained on this base model?"
            ) from None
        inputs = getattr(module, "in_features", getattr(module, "num_embeddings", None))
        outputs = getattr(module, "out_features", getattr(module, "embedding_dim", None))
        if len(a_shape) != 2 or len(b_shape) != 2 or inputs is None or outputs is None:
            raise ModelError(f"{where}: {module_path} is not a layer LoRA can adapt here")
        if a_shape != (a_shape[0], inputs) or b_shape != (outputs, a_shape[0]):
            raise ModelError(
                f"{where}: {module_path} has LoRA shapes A {list(a_shape)}, B {list(b_shape)}; "
                f"the base layer needs A [r, {inputs}] and B [{outputs}, r]; was it trained "
                "on this base model?"
            )
    params = dict(base.named_parameters())
    for path, shape in shapes.whole.items():
        own = params.get(path)
        if own is not None and tuple(own.shape) != shape:
            grown = own.dim() == 2 and shape[1:] == tuple(own.shape[1:]) and shape[0] > own.shape[0]
            why = (
                "; it was trained with tokens added to the vocabulary (model.add_tokens): "
                "serve it on its own (keel serve --model ADAPTER_DIR grows the base to its "
                "tokenizer)"
                if grown
                else "; was it trained on this base model?"
            )
            raise ModelError(
                f"{where}: its {path} is {list(shape)}, the base's {list(own.shape)}{why}"
            )


def _read_config(directory: Path, where: str) -> dict:
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ModelError(
            f"{where} holds no {CONFIG_FILE}; give a PEFT LoRA adapter directory "
            "(e.g. a keel LoRA output dir)"
        )
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelError(f"{where}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{where}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict, where: str, caps: AdapterCaps) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ModelError(
            f"{where}: {CONFIG_FILE} says peft_type {peft_type}; only LoRA adapters can share "
            "a batch (serve it alone: keel serve --model on its folder, or merge it into the "
            "model and serve that)"
        )
    ranks = {"r": config.get("r")}
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise ModelError(f"{where}: {CONFIG_FILE}: rank_pattern must be an object")
    ranks.update({f"rank_pattern[{k!r}]": v for k, v in pattern.items()})
    for key, rank in ranks.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= caps.max_rank:
            raise ModelError(
                f"{where}: {CONFIG_FILE}: {key} is {rank!r}; it must be a whole number from 1 "
                f"to {caps.max_rank} on this server (--max-lora-rank)"
            )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ModelError(f"{where}: {CONFIG_FILE}: lora_alpha {alpha!r} must be a finite number")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS or not isinstance(init, bool | str):
        raise ModelError(
            f"{where}: {CONFIG_FILE}: init_lora_weights {init!r} computes from the base "
            "weights when loaded; save the adapter with plain weights (PEFT converts PiSSA, "
            "OLoRA and others to plain LoRA on save)"
        )
    if config.get("layer_replication"):
        raise ModelError(f"{where}: layer_replication changes the base model; not served")
    if config.get("target_parameters"):
        raise ModelError(
            f"{where}: it adapts weights themselves ({', '.join(config['target_parameters'])}: "
            f"a mixture of experts' fused experts), which cannot share a batch with other "
            f"adapters here; serve it alone (keel serve --model ADAPTER_DIR), or merge it "
            f"(keel export) and serve that"
        )


def _lora_shapes(weights: Path, where: str, caps: AdapterCaps) -> LoraShapes:
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    try:  # reads the header only; it checks every tensor's byte range against the file
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelError(f"{where}: {WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    pairs = {}
    for key, a_shape in shapes.items():
        for a, b in (
            (".lora_A.weight", ".lora_B.weight"),
            (".lora_embedding_A", ".lora_embedding_B"),
        ):
            if key.endswith(a):
                module_path = key.removeprefix("base_model.model.").removesuffix(a)
                b_shape = shapes.get(key.removesuffix(a) + b)
                if b_shape is None:
                    raise ModelError(f"{where}: {WEIGHTS_FILE} holds {key} without its {b[1:]}")
                pairs[module_path] = (a_shape, b_shape)
    if not pairs:
        raise ModelError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights (lora_A/lora_B)")
    whole = {
        key.removeprefix("base_model.model."): shape
        for key, shape in shapes.items()
        if ".lora_" not in key  # LoRA's pairs and DoRA's magnitudes
    }
    for module_path, (a_shape, _) in pairs.items():
        if not a_shape or not 1 <= a_shape[0] <= caps.max_rank:
            raise ModelError(
                f"{where}: {module_path} has rank {a_shape[:1]}; this server takes ranks "
                f"1 to {caps.max_rank} (--max-lora-rank)"
            )
    return LoraShapes(pairs, whole=whole)
