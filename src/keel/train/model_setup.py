"""Build the model a run trains: meta device -> method -> parallelism -> allocate -> load.

The order is what keeps memory flat: sharding is decided while the model has no storage,
so under FSDP each process allocates and loads only its own shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from keel.config import RunConfig
from keel.config.schema import PREFERENCE_STAGES
from keel.distributed.parallelize import (
    apply_ddp,
    apply_fsdp,
    choose_strategy,
    device_memory_bytes,
    local_region,
    local_tensor,
)
from keel.distributed.process_group import DistContext
from keel.models import apply_method, torch_dtype
from keel.models.adapters import decoder_layers
from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
from keel.models.loading import enable_activation_checkpointing
from keel.models.materialize import allocate, build_empty_model, fill_weights, init_computed_buffers
from keel.models.offload import offload_activations
from keel.quant.base import quantize_base, quantized_names
from keel.train.objective import CausalLMObjective, causal_lm_of, use_attention
from keel.train.precision import Precision
from keel.train.preference import PreferenceObjective, reference_mode
from keel.train.reference import build_reference_copy


@dataclass
class TrainingModel:
    model: nn.Module  # the HF or PEFT model (FSDP2-sharded in place under fsdp)
    objective: nn.Module  # what the trainer calls; DDP-wrapped under ddp
    strategy: str  # none | ddp | fsdp
    padding_free: bool = False  # micro-batches laid end to end, on keel's varlen attention


def replica_bytes(model: nn.Module) -> int:
    """Weights + gradients + AdamW state (two fp32 moments) of one full copy."""
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    return weights + sum(p.numel() * (p.element_size() + 8) for p in trainable)


def build_training_model(
    cfg: RunConfig,
    model_dir: Path,
    dist: DistContext,
    precision: Precision,
    log,
    *,
    strategy: str | None = None,
) -> TrainingModel:
    """The model to train, placed on `dist.device`, sharded or replicated.

    `strategy` is the memory plan's choice (single | ddp | fsdp | fsdp_offload); None
    decides here from the size of a replica (when no plan could be made).
    """
    dtype = torch_dtype(cfg.model.dtype) or torch.float32  # auto: fp32 master weights
    model = build_empty_model(
        model_dir,
        dtype=dtype,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(model)
        if cfg.train.gradient_checkpointing == "offload":
            offload_activations(model, dist.device, log)
    # The preflight has built this on the meta device too and logged what trains. New
    # adapter weights go on the meta device as well (keel fills them itself).
    with torch.device("meta"):
        model = apply_method(model, cfg.method, log=lambda _message: None)
    if strategy is None:
        strategy, why = choose_strategy(
            cfg.distributed.strategy,
            dist.world_size,
            replica_bytes(model),
            device_memory_bytes(dist),
        )
        log(f"strategy: {strategy} ({why})")
    offload = strategy == "fsdp_offload" or (
        strategy == "fsdp" and cfg.distributed.fsdp.cpu_offload
    )
    strategy = {"single": "none", "fsdp_offload": "fsdp"}.get(strategy, strategy)
    if cfg.method.type == "qlora":
        layers = decoder_layers(causal_lm_of(model))
        quantize_base(layers, cfg.method.qlora, precision, dist, strategy, log)
    objective = make_objective(cfg, model)
    init_device = dist.device
    if strategy == "fsdp":
        # The objective is the root unit: its forward is what runs (it calls the decoder and
        # output layer directly), so its hooks are the ones that gather the root's weights.
        init_device = _shard(
            objective,
            model,
            cfg.distributed.fsdp.reshard_after_forward,
            dist,
            precision,
            offload,
            log,
        )
    allocate(objective, init_device)
    lm = causal_lm_of(model)
    init_computed_buffers(lm, dist.device)
    fill_weights(model, model_dir, seed=cfg.train.seed, region_of=local_region, local=local_tensor)
    # Every rank probes (under FSDP the probe gathers the root's weights); rank 0's verdict
    # decides, so all ranks run the same forward.
    ok, why = dist.broadcast_object(objective.check_fast_head(dist.device))
    objective.fast_head = ok
    log(f"loss head: {'fast' if ok else 'full Hugging Face forward'} ({why})")
    padding_free = cfg.train.padding_free and _padding_free(objective, model, dist, log)
    if needs_reference_copy(cfg):
        log(
            "reference model: a frozen copy of the base"
            + (" (sharded)" if strategy == "fsdp" else "")
        )
        reference = build_reference_copy(
            cfg, model_dir, dist, precision, sharded=strategy == "fsdp", fast_head=ok
        )
        if padding_free:  # it scores the same concatenated rows
            use_attention(reference.model, VARLEN_ATTENTION)
        objective._reference = (reference,)
    if strategy == "ddp":
        objective = apply_ddp(objective, dist, ignore=quantized_names(objective))
    return TrainingModel(
        model=model, objective=objective, strategy=strategy, padding_free=padding_free
    )


def _padding_free(objective: CausalLMObjective, model: nn.Module, dist: DistContext, log) -> bool:
    """Switch the model to keel's varlen attention if it gives the model's own logits on
    samples laid end to end (rank 0's verdict for all ranks); say which way it went."""
    ok, why = dist.broadcast_object(objective.check_varlen_attention(dist.device))
    if ok:
        register_varlen_attention()
        use_attention(model, VARLEN_ATTENTION)
        log(f"micro-batches: padding-free, samples laid end to end ({why})")
    else:
        log(f"micro-batches: right-padded; padding-free needs keel's varlen attention: {why}")
    return ok


def make_objective(cfg: RunConfig, model: nn.Module) -> nn.Module:
    """The stage's objective: next-token CE for pt/sft, a preference loss otherwise."""
    if cfg.train.stage not in PREFERENCE_STAGES:
        return CausalLMObjective(model, chunk_size=cfg.train.loss_chunk_size)
    return PreferenceObjective(
        model,
        stage=cfg.train.stage,
        settings=cfg.preference,
        chunk_size=cfg.train.loss_chunk_size,
    )


def needs_reference_copy(cfg: RunConfig) -> bool:
    """DPO/KTO with a live reference and no LoRA to switch off: a frozen copy of the base."""
    mode = reference_mode(cfg.train.stage, cfg.preference)
    return mode == "live" and not cfg.method.uses_lora


def _shard(
    root: nn.Module,
    model: nn.Module,
    reshard_after_forward: bool,
    dist: DistContext,
    precision: Precision,
    offload: bool,
    log,
) -> torch.device:
    cpu_offload = offload and dist.device.type == "cuda"
    if offload and not cpu_offload:
        log("distributed.fsdp.cpu_offload: ignored, parameters are already in CPU memory")
    low = precision.autocast_dtype
    lm = causal_lm_of(model)
    units = list(decoder_layers(lm))
    embeddings = lm.get_input_embeddings()
    if embeddings.weight is not lm.get_output_embeddings().weight:
        # Untied input embeddings are their own unit, so the root (output layer + final
        # norm) is not gathered together with a second vocabulary-sized matrix. Tied ones
        # must stay in the root with the output layer that shares them.
        units.insert(0, embeddings)
    apply_fsdp(
        root,
        units,
        dist,
        param_dtype=low,
        reduce_dtype=torch.float32 if low is not None else None,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
    )
    # Offloaded shards live in CPU memory; FSDP2 moves each layer to the GPU when it runs.
    return torch.device("cpu") if cpu_offload else dist.device
