"""Build the model a run trains: meta device -> method -> parallelism -> allocate -> load.

The order is what keeps memory flat: sharding is decided while the model has no storage,
so under FSDP each process allocates and loads only its own shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args, get_type_hints

import torch
from torch import nn

from keel.config import RunConfig
from keel.config.schema import TrainConfig
from keel.distributed.parallelize import (
    ParallelizeSettings,
    device_memory_bytes,
    fsdp_units,
    local_region,
    local_tensor,
    parallelize,
    replicated_parameters,
)
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy, choose_strategy, configured_strategy
from keel.distributed.tensor_parallel import TensorPlan, partial_parameters
from keel.errors import ModelError
from keel.losses import TokenWeighting
from keel.models import apply_method, torch_dtype
from keel.models.attention import (
    VARLEN_ATTENTION,
    context_parallel_problem,
    register_varlen_attention,
    requested_attention,
)
from keel.models.loading import enable_activation_checkpointing
from keel.models.materialize import (
    Starts,
    allocate,
    build_empty_model,
    fill_weights,
    init_computed_buffers,
)
from keel.models.offload import offload_activations
from keel.models.qat import describe as describe_qat
from keel.models.qat import fake_quantize
from keel.models.qlora import quantize_base, quantized_names
from keel.models.tensor_plan import required_tensor_plan
from keel.models.trainable import decoder_layers
from keel.models.vision import VisionFamily, family_of
from keel.models.vocabulary import (
    AddedTokens,
    configured_tokens,
    grow_vocabulary,
    with_trained_embeddings,
)
from keel.precision import Precision
from keel.stages.base import (
    Objective,
    ReferenceSource,
    Stage,
    StageSettings,
    reference_source,
)
from keel.stages.registry import get_stage
from keel.train.grpo_objective import PolicyGradientObjective
from keel.train.objective import (
    CausalLMObjective,
    LossTerms,
    causal_lm_of,
    use_attention,
    vision_modules,
)
from keel.train.preference import PreferenceObjective
from keel.train.reference import build_reference_copy
from keel.train.reward_objective import RewardObjective
from keel.train.router_balance import RouterBalance


@dataclass
class TrainingModel:
    model: nn.Module  # the HF or PEFT model (FSDP2-sharded in place under fsdp)
    objective: nn.Module  # what the trainer calls; DDP-wrapped under ddp
    strategy: Strategy
    padding_free: bool = False  # micro-batches laid end to end, on keel's varlen attention
    # trainable parameters kept whole on every rank, outside DDP/FSDP (a trainable vision
    # tower or projector): the trainer averages their gradients itself
    replicated: list[nn.Parameter] = field(default_factory=list)
    # trainable per-head norms under tensor parallelism: the trainer sums their gradients
    # over the group (keel.distributed.tensor_parallel)
    tp_partial: list[nn.Parameter] = field(default_factory=list)


def replica_bytes(model: nn.Module) -> int:
    """Weights + gradients + AdamW state (two fp32 moments) of one full copy."""
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    return weights + sum(p.numel() * (p.element_size() + 8) for p in trainable)


@dataclass(frozen=True, kw_only=True)
class _Build:
    """What every step of building the training model reads."""

    cfg: RunConfig
    model_dir: Path
    dist: DistContext
    precision: Precision
    log: Callable[[str], None]
    added: AddedTokens | None  # model.add_tokens / add_special_tokens new to the vocabulary


def build_training_model(
    cfg: RunConfig,
    model_dir: Path,
    dist: DistContext,
    precision: Precision,
    log,
    *,
    strategy: Strategy | None = None,
) -> TrainingModel:
    """The model to train, placed on `dist.device`, sharded or replicated.

    `strategy` is the memory plan's choice (single | ddp | fsdp | fsdp_offload); None
    decides here from the size of a replica (when no plan could be made).
    """
    build = _Build(
        cfg=cfg,
        model_dir=model_dir,
        dist=dist,
        precision=precision,
        log=log,
        added=configured_tokens(model_dir, cfg.model),
    )
    model = _model_on_meta(build)
    if problem := context_parallel_problem(model, cfg.distributed.context_parallel):
        raise ModelError(problem)
    dist.dims = dist.dims.with_context(cfg.distributed.context_parallel, dist.device.type)
    tensor = _split_layers(model, cfg, dist, log)
    strategy = _resolve_strategy(strategy, cfg, model, dist, log)
    dist.dims = dist.dims.with_strategy(strategy, cfg.distributed.fsdp.shard_size)
    if cfg.method.type == "qlora":
        layers = decoder_layers(causal_lm_of(model))
        quantize_base(layers, cfg.method.qlora, precision, dist, strategy, log)
    objective = make_objective(cfg, model)
    if cfg.train.token_weighting != "none":
        log(
            f"loss: each target token's cross-entropy weighted ({cfg.train.token_weighting}); "
            "ce_loss is the unweighted one, eval_loss stays unweighted"
        )
    _materialize(build, model, objective, strategy, tensor)
    fast_head = _choose_loss_head(objective, dist, log)
    padding_free, why = False, "train.padding_free is false"
    if cfg.train.padding_free:
        padding_free, why = _padding_free(objective, model, dist, log)
    if dist.cp_size > 1:
        _check_context_parallel(objective, dist, None if padding_free else why, log)
    reference = reference_source_of(cfg)
    if reference == "adapters" and cfg.model.adapter:
        _note_adapter_reference(cfg, log)
    if reference == "copy":
        _attach_reference_copy(
            build, objective, sharded=strategy.shards, fast_head=fast_head, varlen=padding_free
        )
    if strategy.replicates:
        replicated = ParallelizeSettings(
            strategy=strategy,
            ddp_ignore=quantized_names(objective),
            replicated=_vision_modules(model),
        )
        objective = parallelize(objective, dist.dims, replicated)
    return TrainingModel(
        model=model,
        objective=objective,
        strategy=strategy,
        padding_free=padding_free,
        replicated=_trainable_replicas(model, strategy),
        tp_partial=[] if tensor is None else partial_parameters(_layers(model), tensor),
    )


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(decoder_layers(causal_lm_of(model)) or [])


def _split_layers(model: nn.Module, cfg: RunConfig, dist: DistContext, log) -> TensorPlan | None:
    """distributed.tensor_parallel's plan for `model` (with its method applied, on the meta
    device), with the processes grouped into a (dp, tp) mesh; None without it."""
    size = cfg.distributed.tensor_parallel
    if size == 1:
        return None
    tensor = required_tensor_plan(causal_lm_of(model), size)
    dist.dims = dist.dims.with_tensor(size, dist.device.type)
    split = ", ".join(f"{path} {style}" for path, style in tensor.styles.items())
    log(
        f"tensor parallelism: {dist.dp_size} group(s) of {size} processes, each splitting "
        f"every decoder layer ({split})"
    )
    return tensor


def _vision_modules(model: nn.Module) -> list[nn.Module | nn.Parameter]:
    """A vision-language model's tower and projector ([] for a text model)."""
    lm = causal_lm_of(model)
    return vision_modules(lm, family_of(lm.config))


def _trainable_replicas(model: nn.Module, strategy: Strategy) -> list[nn.Parameter]:
    """The trainable parameters of a vision-language model's tower and projector, which
    data parallelism keeps whole on every rank (keel.distributed.parallelize); [] for a
    text model, a frozen tower, or one process."""
    if strategy is Strategy.SINGLE:
        return []
    settings = ParallelizeSettings(strategy=strategy, replicated=_vision_modules(model))
    return [p for p in replicated_parameters(settings) if p.requires_grad]


def _model_on_meta(build: _Build) -> nn.Module:
    """The model without storage (meta device), with activation checkpointing set up and
    the method (full, freeze, LoRA, QLoRA) applied."""
    cfg = build.cfg
    dtype = torch_dtype(cfg.model.dtype) or torch.float32  # auto: fp32 master weights
    model = build_empty_model(
        build.model_dir,
        dtype=dtype,
        attn_implementation=requested_attention(
            cfg.model.attn_implementation, cfg.distributed.context_parallel
        ),
        trust_remote_code=cfg.model.trust_remote_code,
    )
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(model)
        if cfg.train.gradient_checkpointing == "offload":
            offload_activations(model, build.dist.device, build.log)
    # The preflight has built this on the meta device too and logged what trains. New
    # adapter weights go on the meta device as well (keel fills them itself).
    quiet = lambda _message: None  # noqa: E731
    method = cfg.method
    if grow_vocabulary(model, build.added, quiet):
        method = with_trained_embeddings(model, method, quiet)
    with torch.device("meta"):
        model = apply_method(model, method, log=quiet, vision=cfg.model.vision)
    if method.qat.scheme != "none":  # on meta: parallelism and loading see the same params
        build.log(describe_qat(method.qat, fake_quantize(model, method.qat)))
    return model


def _materialize(
    build: _Build,
    model: nn.Module,
    objective: Objective,
    strategy: Strategy,
    tensor: TensorPlan | None,
) -> None:
    """Split and shard the objective while it has no storage (if the strategy shards), then
    allocate this process's part and load the weights into it."""
    cfg, dist = build.cfg, build.dist
    init_device = dist.device
    if strategy.shards:
        # The objective is the root unit: its forward is what runs (it calls the decoder and
        # output layer directly), so its hooks are the ones that gather the root's weights.
        parallelize(objective, dist.dims, _sharded(strategy, cfg, model, build.precision, tensor))
        if strategy is Strategy.FSDP_OFFLOAD:  # FSDP2 moves each layer to the GPU to run it
            init_device = torch.device("cpu")
    allocate(objective, init_device)
    if init_device != dist.device:  # FSDP2 moves only its own units: a replicated vision
        for part in _vision_modules(model):  # tower computes where it is held
            if isinstance(part, nn.Parameter):
                part.data = part.data.to(dist.device)
            else:
                part.to(dist.device)
    lm = causal_lm_of(model)
    init_computed_buffers(lm, dist.device)
    starts = Starts(
        seed=cfg.train.seed,
        adapter_dir=Path(cfg.model.adapter).expanduser() if cfg.model.adapter else None,
        added=build.added,
        lora_init=cfg.method.lora.init if cfg.method.uses_lora else "default",
        pissa_iters=cfg.method.lora.pissa_iters,
    )
    fill_weights(model, build.model_dir, starts, region_of=local_region, local=local_tensor)
    objective.init_new_weights(region_of=local_region, local=local_tensor)  # e.g. rm's head


def _choose_loss_head(objective: CausalLMObjective, dist: DistContext, log) -> bool:
    """Whether the objective's fast loss head (logits only at target positions, in chunks)
    gives the model's own loss, else the full Hugging Face forward; say which."""
    # Every rank probes (under FSDP the probe gathers the root's weights); rank 0's verdict
    # decides, so all ranks run the same forward.
    ok, why = dist.broadcast_object(objective.check_fast_head(dist.device))
    objective.fast_head = ok
    log(f"loss head: {'fast' if ok else 'full Hugging Face forward'} ({why})")
    return ok


def _note_adapter_reference(cfg: RunConfig, log) -> None:
    """With model.adapter, a live LoRA reference is the base without it: say so, and how to
    compare with the adapter the run starts from instead."""
    choices = get_args(get_type_hints(type(cfg.stage_settings))["reference"])
    if "precompute" in choices:
        instead = f"set {cfg.train.stage}.reference: precompute"
    else:
        instead = "merge it into the model (keel export) and train a new adapter on that"
    log(
        f"reference model: the base with every adapter off, model.adapter's too (as TRL and "
        f"LLaMA-Factory do); to compare with the adapter the run starts from, {instead}"
    )


def _attach_reference_copy(
    build: _Build, objective: Objective, *, sharded: bool, fast_head: bool, varlen: bool
) -> None:
    """Give the objective a frozen copy of the base model to score the reference with."""
    build.log("reference model: a frozen copy of the base" + (" (sharded)" if sharded else ""))
    reference = build_reference_copy(
        build.cfg,
        build.model_dir,
        build.dist,
        build.precision,
        sharded=sharded,
        fast_head=fast_head,
    )
    if varlen:  # it scores the same concatenated rows
        use_attention(reference.model, VARLEN_ATTENTION)
    objective._reference = (reference,)


def _check_context_parallel(
    objective: CausalLMObjective, dist: DistContext, not_padding_free: str | None, log
) -> None:
    """Context parallelism runs on padding-free micro-batches (`not_padding_free`: why
    they are not, else None), and only where a row's parts give its logits (every
    process's verdict, all processes stop together)."""
    key = f"distributed.context_parallel = {dist.cp_size}"
    if not_padding_free is not None:
        raise ModelError(
            f"{key} splits padding-free micro-batches, which need keel's varlen attention, "
            f"and it does not run on this model: {not_padding_free}; use 1"
        )
    ok, why = objective.check_context_parallel(dist.cp_group, dist.cp_rank, dist.cp_size)
    failed = dist.all_reduce_sum([0.0 if ok else 1.0])[0]
    if failed:
        where = why if not ok else "the check failed on another process of the run"
        raise ModelError(f"{key}: {where}; use 1")
    log(
        f"context parallelism: {dist.dp_size} group(s) of {dist.cp_size} processes, each "
        f"splitting a micro-batch's tokens (heads exchanged around attention; {why})"
    )


def _padding_free(
    objective: CausalLMObjective, model: nn.Module, dist: DistContext, log
) -> tuple[bool, str]:
    """Switch the model to keel's varlen attention if it gives the model's own logits on
    samples laid end to end (rank 0's verdict for all ranks); say which way it went.
    Returns (switched, why)."""
    ok, why = dist.broadcast_object(objective.check_varlen_attention(dist.device))
    if ok:
        register_varlen_attention()
        use_attention(model, VARLEN_ATTENTION)
        log(f"micro-batches: padding-free, samples laid end to end ({why})")
    else:
        log(f"micro-batches: right-padded; padding-free needs keel's varlen attention: {why}")
    return ok, why


@dataclass
class _ObjectiveKit:
    """What a stage's objective factory builds from (keel.stages.base.ObjectiveKit)."""

    model: nn.Module
    chunk_size: int
    settings: StageSettings | None
    vision: VisionFamily | None = None  # a vision-language model's family
    seed: int = 0  # train.seed: new weights (rm's score head) start from it
    train: TrainConfig | None = None  # pt, sft: token_weighting, router_aux_loss_coef

    def causal_lm(self) -> Objective:
        t = self.train or TrainConfig()
        weighting = None
        if t.token_weighting != "none":
            weighting = TokenWeighting(t.token_weighting, t.eaft_alpha, t.eaft_top_k)
        terms = LossTerms(
            token_weighting=weighting,
            router_balance=RouterBalance.of(causal_lm_of(self.model), t.router_aux_loss_coef),
        )
        return CausalLMObjective(
            self.model, chunk_size=self.chunk_size, vision=self.vision, terms=terms
        )

    def sequence_scores(self, stage: Stage) -> Objective:
        return PreferenceObjective(
            self.model,
            stage=stage,
            settings=self.settings,
            chunk_size=self.chunk_size,
            vision=self.vision,
        )

    def reward_scores(self, stage: Stage) -> Objective:
        return RewardObjective(
            self.model, stage=stage, settings=self.settings, seed=self.seed, vision=self.vision
        )

    def policy_gradient(self, stage: Stage) -> Objective:
        return PolicyGradientObjective(
            self.model, settings=self.settings, chunk_size=self.chunk_size, vision=self.vision
        )


def make_objective(cfg: RunConfig, model: nn.Module) -> Objective:
    """The objective of the run's stage, from its factory in the stage registry."""
    stage = get_stage(cfg.train.stage)
    kit = _ObjectiveKit(
        model=model,
        chunk_size=cfg.train.loss_chunk_size,
        settings=cfg.stage_settings,
        vision=family_of(causal_lm_of(model).config),
        seed=cfg.train.seed,
        train=cfg.train,
    )
    return stage.objective(kit, stage)


def reference_source_of(cfg: RunConfig) -> ReferenceSource | None:
    """Where this run's reference log-probs come from (keel.stages.base.reference_source)."""
    stage = get_stage(cfg.train.stage)
    return reference_source(stage, cfg.stage_settings, cfg.method.reference_by_adapters_off)


def _resolve_strategy(
    planned: Strategy | None, cfg: RunConfig, model: nn.Module, dist: DistContext, log
) -> Strategy:
    """The plan's strategy, else the config's, else auto's from the size of a replica; then
    fsdp with distributed.fsdp.cpu_offload is fsdp_offload (also when auto chose fsdp),
    except on a CPU, where there is nothing to offload from."""
    strategy = planned
    if dist.tp_size > 1 and (strategy is None or not Strategy(strategy).shards):
        strategy = Strategy.FSDP
        log("strategy: fsdp (tensor parallelism: FSDP2 shards the split layers over dp)")
    if strategy is None:
        requested = configured_strategy(
            cfg.distributed.strategy,
            cpu_offload=cfg.distributed.fsdp.cpu_offload,
            dp_size=dist.dp_size,
            cuda=dist.device.type == "cuda",
        )
        strategy, why = choose_strategy(
            requested, dist.dp_size, replica_bytes(model), device_memory_bytes(dist)
        )
        log(f"strategy: {strategy} ({why})")
    strategy = Strategy(strategy)
    offload = strategy is Strategy.FSDP_OFFLOAD or (
        strategy is Strategy.FSDP and cfg.distributed.fsdp.cpu_offload
    )
    if not offload:
        return strategy
    if dist.device.type != "cuda":
        log("distributed.fsdp.cpu_offload: ignored, parameters are already in CPU memory")
        return Strategy.FSDP
    return Strategy.FSDP_OFFLOAD


def _sharded(
    strategy: Strategy,
    cfg: RunConfig,
    model: nn.Module,
    precision: Precision,
    tensor: TensorPlan | None,
) -> ParallelizeSettings:
    """The policy's FSDP2 layout: each decoder layer and untied input embeddings are units
    (split first by `tensor`, under tensor parallelism); compute in the autocast dtype,
    gradients reduced in fp32."""
    low = precision.autocast_dtype
    lm = causal_lm_of(model)
    return ParallelizeSettings(
        strategy=strategy,
        units=fsdp_units(lm, decoder_layers(lm), embeddings=True),
        replicated=_vision_modules(model),
        reshard_after_forward=cfg.distributed.fsdp.reshard_after_forward,
        cpu_offload=strategy is Strategy.FSDP_OFFLOAD,
        param_dtype=low,
        reduce_dtype=torch.float32 if low is not None else None,
        tensor=tensor,
    )
