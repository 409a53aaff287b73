"""The one preflight of `keel train` and `keel validate`: everything checkable before training.

Order: resolve the model; build it on the meta device and apply the method exactly as
training does (seconds: no weight is read); check precision, attention and strategy against
this machine; load the tokenizer; check the data settings (paths, template). Every problem
found so far is raised at once, as one ConfigError, *before* any data row is read. Only
then is the data validated and tokenized, which can take minutes on a large dataset.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keel.config import RunConfig
from keel.config.schema import MethodConfig
from keel.data import PreparedData, prepare_data
from keel.data.sources import resolve_sources
from keel.data.stream import StreamedData, prepare_stream
from keel.data.template import resolve_template
from keel.distributed.process_group import choose_device
from keel.errors import ConfigError, DataError, ModelError
from keel.models import count_parameters, load_tokenizer, resolve_model_path, torch_dtype
from keel.models.adapters import apply_method, method_problems
from keel.models.attention import requested_attention
from keel.models.experts import fused_experts
from keel.models.loading import enable_activation_checkpointing
from keel.models.materialize import build_empty_model
from keel.models.qat import qat_problems
from keel.models.sequence_classifier import sequence_classifier_problem
from keel.models.tensor_plan import split_problems
from keel.models.trainable import find_decoder_layers
from keel.models.vision import VisionProcessing, family_of, vision_processing
from keel.models.vocabulary import (
    add_configured_tokens,
    configured_tokens,
    grow_vocabulary,
    with_trained_embeddings,
)
from keel.precision import Precision, resolve_precision
from keel.quant import import_torchao
from keel.rewards import RewardFunction
from keel.stages.registry import get_stage
from keel.train.batch_source import StepPlan, default_global_batch
from keel.train.online_rl_checks import online_rl_checks
from keel.train.output_folder import unwritable_reason

Log = Callable[[str], None]


@dataclass
class ModelCheck:
    """What the meta-device build found: the architecture and what trains, no weights read."""

    architecture: str  # e.g. LlamaForCausalLM
    model_type: str  # e.g. llama
    decoder_layers: int | None  # None: keel cannot find them (no freeze, no fsdp)
    params: int  # the model's own, tied weights once
    trainable: int  # after the method is applied (0 when it cannot be)
    total: int  # after the method is applied: params plus any adapter weights
    vocab_rows: int | None  # rows of the input embeddings
    dtype: torch.dtype
    attn_implementation: str
    method: str  # full | freeze | lora
    seconds: float  # how long building and applying the method took

    def describe(self) -> str:
        layers = "" if self.decoder_layers is None else f", {self.decoder_layers} decoder layers"
        return (
            f"{self.architecture} ({self.model_type}{layers}): {self.params:,} parameters, "
            f"{str(self.dtype).removeprefix('torch.')}, attention "
            f"{self.attn_implementation}"
        )

    def describe_method(self) -> str:
        share = 100 * self.trainable / max(self.total, 1)
        return (
            f"{self.method}: {self.trainable:,} of {self.total:,} parameters trainable "
            f"({share:.2f}%)"
        )


@dataclass
class Preflight:
    """What a run needs from its preflight."""

    model_dir: Path
    tokenizer: object
    data: PreparedData | StreamedData
    model: ModelCheck
    precision: Precision  # as resolved for `device` (auto measured here on a CPU)
    device: torch.device
    notes: list[str] = field(default_factory=list)  # settings that are ignored here
    config: RunConfig | None = None  # what was checked (for the summary's steps)
    # an online-RL stage's (grpo) reward functions, user files imported before any model
    rewards: list[RewardFunction] = field(default_factory=list)

    def summary(self, processes: int = 1) -> list[str]:
        """One line per part, for `keel validate` (steps as `processes` would train)."""
        totals = self.data.report.totals()
        eval_rows = len(self.data.eval) if self.data.eval is not None else 0
        rows = self.data.num_rows
        data = (
            f"{len(self.data.files)} file(s), read as training goes (data.streaming)"
            if rows is None
            else f"{totals.read} rows read, {totals.kept} kept -> {rows} train rows, "
            f"{eval_rows} eval rows"
        )
        return [
            f"model:     {self.model.describe()}",
            f"method:    {self.model.describe_method()}",
            f"precision: {self.precision.name} on {self.device} ({self.precision.reason})",
            f"data:      {data}",
            *([f"steps:     {_schedule(self.config, rows, processes)}"] if self.config else []),
            *(f"note:      {note}" for note in self.notes),
        ]


def _machine_checks(cfg: RunConfig, device: torch.device, log: Log):
    """(precision, attention, problems, notes) of the settings this machine decides:
    precision, attention and optimizer support; notes name the settings it ignores."""
    precision, problems = _precision(cfg, device)
    attn, found = _attention(cfg, device)
    problems += found + _optimizer(cfg, device)
    notes = _ignored_settings(cfg, device)
    for note in notes:
        log(f"note: {note}")
    return precision, attn, problems, notes


def preflight(
    cfg: RunConfig,
    *,
    base_dir: Path,
    log: Log = print,
    device: torch.device | None = None,
    source: str | None = None,
    model_dir: Path | None = None,
) -> Preflight:
    """Check everything about `cfg` short of training, then validate + tokenize its data.

    `device` defaults to the one this machine trains on (`choose_device(0)`); `source` names
    the config in the error. Problems with the model, method, precision, attention, strategy,
    tokenizer and data settings are found in seconds and raised together as one
    ConfigError before any data row is read; problems in the rows are DataErrors from
    `prepare_data`. Touches no output folder. `model_dir`: model.path already resolved
    (training fetches a Hub model once per node first; see keel.train.hub_fetch).
    """
    device = choose_device(0) if device is None else device
    precision, attn, problems, notes = _machine_checks(cfg, device, log)
    tokenizer = checked = vision = None
    model_dir, found = _model_dir(cfg, model_dir, log)
    problems += found
    if model_dir is not None:
        checked, found = check_model(cfg, model_dir, attn=attn, precision=precision, log=log)
        problems += found
        tokenizer, found = _tokenizer(cfg, model_dir, checked, log)
        problems += found
        if checked is not None and not found:  # a model keel builds, with its tokenizer
            vision, found = _vision(cfg, model_dir, log)
            problems += found
    rewards, found = online_rl_checks(cfg, base_dir, device)
    problems += _data_settings(cfg, tokenizer, base_dir) + _output_problems(cfg) + found
    if problems:
        raise ConfigError(problems, source=source)
    cache_dir = Path(cfg.model.cache_dir).expanduser()
    where = {"stage": cfg.train.stage, "cache_dir": cache_dir, "base_dir": base_dir}
    # streamed: read as training goes, only checked and fingerprinted here
    prepare = prepare_stream if cfg.data.streaming else prepare_data
    data = prepare(cfg.data, tokenizer, **where, seed=cfg.train.seed, log=log, vision=vision)
    return Preflight(
        model_dir=model_dir,
        tokenizer=tokenizer,
        data=data,
        model=checked,
        precision=precision,
        device=device,
        notes=notes,
        config=cfg,
        rewards=rewards,
    )


def _model_dir(cfg: RunConfig, model_dir: Path | None, log: Log) -> tuple[Path | None, list[str]]:
    """model.path as a local folder (`model_dir` when the caller resolved it already), or
    None and why it cannot be had."""
    if model_dir is not None:
        return model_dir, []
    try:
        return resolve_model_path(
            cfg.model.path, cfg.model.cache_dir, log=log, revision=cfg.model.revision
        ), []
    except ModelError as exc:
        return None, [str(exc)]


def _output_problems(cfg: RunConfig) -> list[str]:
    unwritable = unwritable_reason(Path(cfg.output.dir).expanduser())
    return [unwritable] if unwritable else []


def _schedule(cfg: RunConfig, rows: int | None, processes: int) -> str:
    """Steps and epochs as `processes` would run them: without train.global_batch_size,
    N processes take N times larger batches, so fewer steps per epoch (said when that
    applies)."""
    t = cfg.train
    per_step = default_global_batch(t.micro_batch_size, t.grad_accum, processes)
    plan = StepPlan.of(cfg, rows, t.global_batch_size or per_step)
    line = plan.schedule(t.epochs, t.max_steps)
    if t.global_batch_size:
        return line
    return f"{line}, on {processes} process{'es' if processes > 1 else ''}"


def check_model(
    cfg: RunConfig, model_dir: Path, *, attn: str, precision: Precision | None, log: Log = print
) -> tuple[ModelCheck | None, list[str]]:
    """Build the model on the meta device as training does, enable gradient checkpointing
    and apply the method; (what was found, every problem). None when it cannot be built."""
    started = time.perf_counter()
    dtype = torch_dtype(cfg.model.dtype) or torch.float32  # auto: fp32 master weights
    try:
        model = build_empty_model(
            model_dir,
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    except ModelError as exc:
        return None, [str(exc)]
    method, problems = _added_tokens(cfg, model_dir, model, log)
    layers = find_decoder_layers(model)
    params = count_parameters(model)[1]
    checked = ModelCheck(
        architecture=type(model).__name__,
        model_type=getattr(model.config, "model_type", "?"),
        decoder_layers=None if layers is None else len(layers),
        params=params,
        trainable=0,
        total=params,
        dtype=dtype,
        attn_implementation=_chosen_attention(cfg.model.attn_implementation, model),
        vocab_rows=getattr(model.get_input_embeddings(), "num_embeddings", None),
        method=cfg.method.type,
        seconds=time.perf_counter() - started,
    )
    log(f"model: {checked.describe()}; built on the meta device in {checked.seconds:.2f} s")
    problems += [*_checkpointing(cfg, model), *_fsdp(cfg, model, layers), *_experts(cfg, model)]
    problems += qat_problems(model, cfg.method.qat)
    problems += split_problems(model, cfg.distributed)
    if get_stage(cfg.train.stage).head == "score":  # rm: written as a sequence classifier
        problems += filter(None, [sequence_classifier_problem(model.config)])
    refused = method_problems(model, method)
    problems += refused
    if not refused:
        # PEFT creates adapter weights on the default device before moving them next to
        # the base layer's (meta): building them on meta keeps this allocation-free.
        try:
            with torch.device("meta"):
                model = apply_method(model, method, log=log, vision=cfg.model.vision)
        except ValueError as exc:  # PEFT's own refusals, past what method_problems knows
            return checked, [*problems, f"method.type = {cfg.method.type}: {exc}"]
        problems += _fp16_weights(cfg, model, precision)
        checked.trainable, checked.total = count_parameters(model)
    checked.seconds = time.perf_counter() - started
    return checked, problems


def _added_tokens(
    cfg: RunConfig, model_dir: Path, model: torch.nn.Module, log: Log
) -> tuple[MethodConfig, list[str]]:
    """Grow the meta model for model.add_tokens / add_special_tokens as training does;
    (the method with the embeddings it then trains, the problems)."""
    try:
        added = configured_tokens(model_dir, cfg.model)
    except ModelError:  # the tokenizer does not load: _tokenizer reports that
        return cfg.method, []
    if added is not None and family_of(model.config) is not None:
        key = "model.add_tokens" if cfg.model.add_tokens else "model.add_special_tokens"
        return cfg.method, [
            f"{key}: {type(model).__name__} is a vision-language model, whose processor "
            f"keeps its own tokenizer; keel adds tokens to text models only"
        ]
    if not grow_vocabulary(model, added, log):
        return cfg.method, []
    return with_trained_embeddings(model, cfg.method, log), []


def _precision(cfg: RunConfig, device: torch.device) -> tuple[Precision | None, list[str]]:
    requested = cfg.train.precision
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        # torch.autocast refuses it at the first step ("does not support bfloat16").
        name = torch.cuda.get_device_name(device)
        return None, [
            f"train.precision = bf16: this GPU ({name}) has no bf16 support; use fp16 or auto"
        ]
    try:
        return resolve_precision(requested, device), []
    except ConfigError as exc:
        return None, exc.problems


def _attention(cfg: RunConfig, device: torch.device) -> tuple[str, list[str]]:
    """(the attention to build the meta model with, problems with model.attn_implementation)."""
    attn = requested_attention(cfg.model.attn_implementation, cfg.distributed.context_parallel)
    if attn != "flash_attention_2":
        return attn, []
    key = "model.attn_implementation = flash_attention_2"
    if device.type != "cuda":
        problem = f"{key} needs a CUDA GPU and this machine has none; use auto (the default)"
    else:
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return attn, []
        problem = (
            f"{key} needs the flash-attn package (>= 2.3.3), which is not installed "
            f"here; pip install flash-attn --no-build-isolation, or use auto (the default)"
        )
    # Every architecture has eager attention: the other checks still run on the model.
    return "eager", [problem]


def _chosen_attention(requested: str, model: torch.nn.Module) -> str:
    """What the model was built with, and for `auto` that it was chosen."""
    built = model.config._attn_implementation
    return f"{built} (auto)" if requested == "auto" else built


def _optimizer(cfg: RunConfig, device: torch.device) -> list[str]:
    """torchao's 8/4-bit AdamW: importable, and a compiler for the update it compiles.

    torch.compile turns the first step's update into C++ on a CPU (inductor runs $CXX, else
    g++) and into Triton kernels on a GPU (Triton builds its launcher with $CC, else gcc or
    clang); without one the first step fails after the model has loaded.
    """
    choice = cfg.train.optimizer
    if choice in ("adamw", "muon"):
        return []
    key = f"train.optimizer = {choice}"
    try:
        import_torchao("optim", needed_for=key)
    except ConfigError as exc:
        return exc.problems
    if device.type == "cuda":
        wanted = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "clang"]
    else:
        wanted = [os.environ.get("CXX") or "g++"]
    if any(shutil.which(name) for name in wanted):
        return []
    return [
        f"{key} compiles its update at the first step (torch.compile), which needs a C/C++ "
        f"compiler on {device.type}; none of {' or '.join(wanted)} was found on PATH. "
        f"Install one (e.g. apt-get install g++, or set CC/CXX), or use train.optimizer=adamw"
    ]


def _ignored_settings(cfg: RunConfig, device: torch.device) -> list[str]:
    """Settings that are valid but change nothing on this machine: notes, not errors."""
    fsdp, strategy = cfg.distributed.fsdp, cfg.distributed.strategy
    if not fsdp.cpu_offload:
        return []
    if strategy == "ddp":
        return [
            "distributed.fsdp.cpu_offload = true is ignored with distributed.strategy = "
            "ddp (it only applies to fsdp)"
        ]
    if device.type != "cuda":
        return [
            "distributed.fsdp.cpu_offload = true is ignored on this machine: there is no "
            "CUDA GPU, so parameters already live in CPU memory"
        ]
    return []


def _checkpointing(cfg: RunConfig, model: torch.nn.Module) -> list[str]:
    value = str(cfg.train.gradient_checkpointing).lower()
    if not cfg.train.gradient_checkpointing:
        return []
    if not getattr(model, "supports_gradient_checkpointing", False):
        return [
            f"train.gradient_checkpointing = {value}, but {type(model).__name__} does not "
            f"support gradient checkpointing in transformers; set "
            f"train.gradient_checkpointing=false (or use a smaller micro_batch_size)"
        ]
    try:  # as keel.train.model_setup does it, so any other refusal surfaces here
        enable_activation_checkpointing(model)
    except ValueError as exc:
        return [
            f"train.gradient_checkpointing = {value}: {exc}; set train.gradient_checkpointing=false"
        ]
    return []


def _fsdp(cfg: RunConfig, model: torch.nn.Module, layers) -> list[str]:
    if cfg.distributed.strategy != "fsdp" or layers is not None:
        return []
    return [
        f"distributed.strategy = fsdp shards the model one decoder layer at a time, but "
        f"keel cannot find the decoder layers of {type(model).__name__} (looked at "
        f"model.get_decoder().layers and model.model.layers); use distributed.strategy "
        f"ddp"
    ]


def _experts(cfg: RunConfig, model: torch.nn.Module) -> list[str]:
    qlora = cfg.method.qlora
    if cfg.method.type != "qlora" or not qlora.quantize_experts or fused_experts(model):
        return []
    return [
        f"method.qlora.quantize_experts = true: {type(model).__name__} has no fused routed "
        f"experts (not a mixture of experts as transformers 5 holds them); remove it"
    ]


def _fp16_weights(cfg: RunConfig, model: torch.nn.Module, precision: Precision | None) -> list[str]:
    # fp16 loss scaling unscales gradients in place; torch refuses fp16 gradients there
    # ("Attempting to unscale FP16 gradients"), i.e. at the end of the first step.
    if precision is None or precision.name != "fp16":
        return []
    if not any(p.requires_grad and p.dtype == torch.float16 for p in model.parameters()):
        return []
    return [
        f"model.dtype = float16 with train.precision = fp16 ({precision.reason}) trains "
        f"float16 weights, whose gradients fp16 loss scaling cannot unscale; set "
        f"model.dtype=auto (float32 master weights, fp16 compute), or use method.type lora"
    ]


def _tokenizer(
    cfg: RunConfig, model_dir: Path, checked: ModelCheck | None, log: Log
) -> tuple[object | None, list[str]]:
    try:
        tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    except ModelError as exc:
        return None, [str(exc)]
    add_configured_tokens(tokenizer, cfg.model)  # as check_model grew the model for
    rows = checked.vocab_rows if checked is not None else None
    if rows is None:
        return tokenizer, []
    special = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id} - {None}
    outside = sorted(i for i in special if i >= rows)
    if outside:
        # eos ends every sample and pad fills every batch: the first step would index past
        # the embedding matrix.
        return tokenizer, [
            f"model.path = {cfg.model.path}: the tokenizer's special token "
            f"ids {outside} are >= the {rows} rows of the model's input "
            f"embeddings; use the tokenizer saved with this model"
        ]
    if len(tokenizer) > rows:
        log(
            f"note: the tokenizer has {len(tokenizer)} tokens but the model's embeddings "
            f"{rows} rows; a sample holding a token id >= {rows} would fail"
        )
    return tokenizer, []


def _vision(cfg: RunConfig, model_dir: Path, log: Log) -> tuple[VisionProcessing | None, list[str]]:
    """The model's image processing (None for a text model) and the settings its family
    cannot train exactly."""
    try:
        vision = vision_processing(model_dir, cfg.model.vision, log)
    except ModelError as exc:  # e.g. no preprocessor_config.json in the folder
        return None, [str(exc)]
    if vision is None or not cfg.data.packing or vision.family.image_attention == "causal":
        return vision, []
    # transformers 5.24 (Gemma 3) adds the image blocks to the sliding-window layers' mask
    # with positions renumbered per packed sample: every sample after the first gets the
    # first sample's image blocks, not its own
    return vision, [
        f"data.packing = true: {vision.family.name}'s image tokens attend to each other both "
        "ways, and transformers builds that mask wrongly for packed samples (in the "
        "sliding-window layers, every sample after the first gets the first one's image "
        "blocks); set data.packing=false"
    ]


def _data_settings(cfg: RunConfig, tokenizer, base_dir: Path) -> list[str]:
    """Data paths and the template: checked without reading a row."""
    problems = []
    for held_out in (False, True):
        try:
            resolve_sources(cfg.data, Path(base_dir), stage=cfg.train.stage, held_out=held_out)
        except DataError as exc:
            problems.append(str(exc))
    if tokenizer is not None:
        try:
            resolve_template(cfg.data.template, tokenizer, Path(base_dir))
        except DataError as exc:
            problems.append(str(exc))
    return problems
