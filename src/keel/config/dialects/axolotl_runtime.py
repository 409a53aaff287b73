"""How an Axolotl run executes, not what it computes: FSDP (`fsdp`, `fsdp_config`,
`fsdp_version`) and DeepSpeed as keel's distributed settings, and the speed-only kernels and
plugins (Liger, Cut Cross Entropy, Axolotl's LoRA kernels), which keel ignores saying why:
they compute the same loss. A plugin that changes the training itself is refused."""

from __future__ import annotations

from keel.config.dialects.build import Build
from keel.config.dialects.deepspeed import apply_deepspeed
from keel.config.dialects.report import unknown_key


def _fsdp(build: Build, key: str, value) -> None:
    options = [value] if isinstance(value, str) else (value or [])
    if options and build.raw.get("dp_shard_size") == 1:
        build.ignored(key, "dp_shard_size 1: no sharding (ddp)")
    elif "full_shard" in options or "shard_grad_op" in options:
        build.put(key, "distributed.strategy", "fsdp", "FSDP2, one shard per decoder layer")
        if "shard_grad_op" in options:
            build.set("distributed.fsdp.reshard_after_forward", False)
    elif not options:
        build.ignored(key, "empty: no FSDP")
    else:
        build.refused(key, f"{value!r}: keel's FSDP is full_shard (or shard_grad_op)")


def _fsdp_version(build: Build, key: str, value) -> None:
    build.ignored(key, f"{value}: keel's FSDP is FSDP2 (fully_shard) whichever version is named")


_FSDP_IGNORED = {
    "version": "keel's FSDP is FSDP2",
    "state_dict_type": "keel writes the final model as a Hugging Face folder and its "
    "checkpoints in its own layout",
    "transformer_layer_cls_to_wrap": "keel shards each decoder layer",
    "auto_wrap_policy": "keel shards each decoder layer",
    "limit_all_gathers": "an FSDP1 setting; FSDP2 has no such knob",
    "sync_module_states": "keel loads the same weights on every process",
    "use_orig_params": "an FSDP1 setting; FSDP2 keeps the original parameters",
    "cpu_ram_efficient_loading": "keel loads the weights on the meta device, then shards them",
    "backward_prefetch": "FSDP2 prefetches on its own",
    "forward_prefetch": "FSDP2 prefetches on its own",
}
_FSDP_MAPPED = ("offload_params", "reshard_after_forward", "activation_checkpointing")


def _fsdp_config(build: Build, key: str, value) -> None:
    """Each setting, spelt with or without Axolotl's older `fsdp_` prefix."""
    if not isinstance(value, dict):
        build.ignored(key, "empty") if value is None else build.refused(key, "must be a mapping")
        return
    if not build.raw.get("fsdp") and build.raw.get("dp_shard_size") != 1:
        build.set("distributed.strategy", "fsdp")  # Axolotl's newer configs use fsdp_config alone
    for name, item in value.items():
        short, dotted = name.removeprefix("fsdp_"), f"{key}.{name}"
        if short == "offload_params":
            build.put(dotted, "distributed.fsdp.cpu_offload", bool(item))
        elif short == "reshard_after_forward":
            build.put(dotted, "distributed.fsdp.reshard_after_forward", bool(item))
        elif short == "activation_checkpointing":
            build.put(dotted, "train.gradient_checkpointing", bool(item))
        elif short == "sharding_strategy" and item in ("FULL_SHARD", 1):
            build.put(dotted, "distributed.strategy", "fsdp")
        elif short == "sharding_strategy" and item in ("SHARD_GRAD_OP", 2):
            build.put(dotted, "distributed.fsdp.reshard_after_forward", False)
        elif short in _FSDP_IGNORED:
            build.ignored(dotted, _FSDP_IGNORED[short])
        else:
            why = "an FSDP setting keel has no counterpart for; remove it"
            known = [*_FSDP_IGNORED, *_FSDP_MAPPED, "sharding_strategy"]
            build.refused(dotted, unknown_key(short, known, why))


def offloads_activations(raw: dict) -> bool:
    """Whether the config moves activations to host memory (activation_offloading)."""
    return raw.get("activation_offloading") in (True, "legacy")


def _activation_offloading(build: Build, key: str, value) -> None:
    if offloads_activations(build.raw):
        why = (
            "keel recomputes each layer in backward and keeps its saved input in pinned host "
            "memory: the activations leave the device, as with Axolotl's offloading"
        )
        build.put(key, "train.gradient_checkpointing", "offload", why)
    elif not value:
        build.ignored(key, "false: activations stay on the device")
    else:
        build.refused(key, f"{value!r}: keel offloads activations to host memory only (true)")


_SAME_LOSS = "a faster kernel for the same computation; keel uses PyTorch's own operations"
_CHUNKED_LOSS = (
    "computes the output layer and cross-entropy without holding every logit; keel computes "
    "them in chunks (train.loss_chunk_size): the same loss"
)
# Plugins that only make the same computation faster or leaner; any other plugin changes
# what is trained (or how it is logged) in ways keel does not follow, and is refused.
_SPEED_PLUGINS = {
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": f"Cut Cross Entropy "
    f"{_CHUNKED_LOSS}",
    "axolotl.integrations.liger.LigerPlugin": "Liger's fused kernels (RoPE, RMSNorm, SwiGLU, "
    "cross-entropy) compute the same math; keel uses PyTorch's own operations and its "
    "chunked output layer and cross-entropy",
    "axolotl.integrations.kernels.KernelsPlugin": "its kernels compute a mixture of experts' "
    "experts as transformers' grouped matmuls do, which keel runs",
}
# Kernel choices for a mixture of experts' experts (and the Hub kernels they come from): the
# same computation as transformers' grouped_mm experts, faster on their GPUs.
_EXPERT_KERNELS = ("use_kernels", "use_scattermoe", "use_sonicmoe")


def _expert_kernels(build: Build, key: str, value) -> None:
    if not value:
        build.ignored(key, "false: off")
    else:
        build.ignored(
            key, "the experts' kernels compute what transformers' grouped_mm does, which keel runs"
        )


def _plugins(build: Build, key: str, value) -> None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        build.refused(key, "must be a list of plugin class paths")
        return
    for index, name in enumerate(names):
        dotted = f"{key}.{index}"
        if name in _SPEED_PLUGINS:
            build.ignored(dotted, f"{name}: {_SPEED_PLUGINS[name]}")
        else:
            build.refused(dotted, f"{name}: an Axolotl plugin keel does not run; remove it")


def _kernel_switch(build: Build, key: str, value) -> None:
    """A switch of the Liger or Cut Cross Entropy plugins, or of Axolotl's LoRA kernels."""
    if key == "liger_use_token_scaling" and value:
        build.refused(key, "scales each token's loss; keel's cross-entropy is the plain mean")
    elif not value:
        build.ignored(key, "false: off")
    elif key == "cut_cross_entropy":
        build.ignored(key, f"Cut Cross Entropy {_CHUNKED_LOSS}")
    else:
        build.ignored(key, _SAME_LOSS)


_KERNEL_SWITCHES = (
    "cut_cross_entropy",
    "liger_rope",
    "liger_rms_norm",
    "liger_rms_norm_gated",
    "liger_layer_norm",
    "liger_swiglu",
    "liger_glu_activation",
    "liger_cross_entropy",
    "liger_fused_linear_cross_entropy",
    "liger_use_token_scaling",
    "lora_mlp_kernel",
    "lora_qkv_kernel",
    "lora_o_kernel",
)


# Speed-only settings of Axolotl's own: the same computation, compiled or fused
_SPEED_ONLY = {
    "torch_compile": "keel runs the model eagerly (torch.compile changes speed, not the math)",
    "torch_compile_backend": "keel does not compile the model",
    "torch_compile_mode": "keel does not compile the model",
    "flex_attn_compile_kwargs": "options for compiling flex attention, which keel does not use",
    "fused_attn_kernel": "a fused kernel for q/k RMSNorm and RoPE: the same math, which "
    "keel computes with PyTorch's own operations",
    "flash_attn_cross_entropy": f"flash-attn's cross-entropy: {_CHUNKED_LOSS}",
    "flash_attn_fuse_mlp": "a fused MLP kernel: the same math as the model's own MLP",
    "flash_attn_rms_norm": "a fused RMSNorm kernel: the same math as the model's own",
    "gemma4_hybrid_attn_impl": "flash attention for the sliding-window layers beside sdpa for "
    "the global ones: the same attention, which keel computes with model.attn_implementation",
    "tiled_mlp": "each MLP computed over the row in tiles to hold less memory: the same math, "
    "which keel computes whole (keel plan counts its activations; for long rows, "
    "distributed.context_parallel splits them over processes)",
    "tiled_mlp_num_shards": "the tiles of tiled_mlp, which keel does not tile",
}


def _speed_only(build: Build, key: str, value) -> None:
    build.ignored(key, "false: off" if value is False else _SPEED_ONLY[key])


def _bnb_config_kwargs(build: Build, key: str, value) -> None:
    """Overrides of bitsandbytes' 4-bit config: the ones that say what keel does anyway."""
    if not build.mapping(key, value, empty="empty: the defaults", what="a mapping"):
        return
    same = {
        "bnb_4bit_use_double_quant": (True, "keel's NF4 quantises the block scales too"),
        "bnb_4bit_quant_type": ("nf4", "keel's 4-bit base is NF4"),
    }
    for name, item in value.items():
        dotted = f"{key}.{name}"
        if name in same and item == same[name][0]:
            build.ignored(dotted, same[name][1])
        else:
            build.refused(dotted, f"{item!r}: keel's 4-bit base is NF4 with quantised scales")


def _data_parallel_sizes(build: Build, key: str, value) -> None:
    """dp_shard_size: processes per sharded copy (HSDP when fewer than the processes);
    dp_replicate_size: the copies, which keel derives from the processes."""
    if key == "dp_shard_size" and isinstance(value, int) and value >= 2:
        build.put(key, "distributed.fsdp.shard_size", value, "each copy sharded over this many")
    elif key == "dp_shard_size" and value == 1:
        build.put(key, "distributed.strategy", "ddp", "a whole copy on every process")
    elif key == "dp_shard_size":
        build.refused(key, f"{value!r}: the processes each copy is sharded over, 1 or more")
    elif build.raw.get("dp_shard_size"):
        build.ignored(key, "keel makes processes / dp_shard_size copies, as the launch decides")
    else:
        build.refused(key, "keel's copies are processes / shard size: set dp_shard_size instead")


_CONTEXT_PARALLEL_KEYS = (
    "context_parallel_size", "sequence_parallel_degree", "heads_k_stride", "ring_attn_func",
)  # fmt: skip


def _context_parallel(build: Build, key: str, value) -> None:
    """context_parallel_size (sequence_parallel_degree before it): processes that split each
    row's tokens; their ring-attention settings only say how the same attention is run."""
    if key in ("heads_k_stride", "ring_attn_func"):
        build.ignored(key, f"{value}: a setting of ring-flash-attn's {_RING}")
    else:
        _group_size(build, key, value, "context", ("each row's tokens", f"; {_RING}", "a row"))


def _tensor_parallel(build: Build, key: str, value) -> None:
    """tensor_parallel_size: processes that split each decoder layer (DTensor's colwise and
    rowwise layers over transformers' plan for the model, as Axolotl's)."""
    split = ("each decoder layer's heads and MLP columns", "", "a layer")
    _group_size(build, key, value, "tensor", split)


def _group_size(build: Build, key: str, value, kind: str, split: tuple[str, str, str]) -> None:
    """A number of processes that split something (`kind` parallelism): above 1 it is
    distributed.<kind>_parallel; 1 (or none) ignored. `split`: (what each process holds a
    part of, a note on the mapping, what one group splits)."""
    what, note, unit = split
    if value in (None, 1):
        build.ignored(key, f"{value}: no {kind} parallelism")
    elif isinstance(value, int) and not isinstance(value, bool) and value > 1:
        why = f"{what} split over {value} processes{note}"
        build.put(key, f"distributed.{kind}_parallel", value, why)
    else:
        build.refused(key, f"{value!r}: the processes that split {unit}, a whole number >= 1")


_RING = (
    "keel exchanges heads for tokens around attention (the Ulysses layout) where Axolotl "
    "passes keys and values round a ring: the same attention, computed another way"
)


RUNTIME_HANDLERS = {
    **{key: _context_parallel for key in _CONTEXT_PARALLEL_KEYS},
    **{key: _speed_only for key in _SPEED_ONLY},
    "bnb_config_kwargs": _bnb_config_kwargs,
    "tensor_parallel_size": _tensor_parallel,
    "dp_shard_size": _data_parallel_sizes,
    "dp_replicate_size": _data_parallel_sizes,
    "fsdp": _fsdp,
    "fsdp_config": _fsdp_config,
    "fsdp_version": _fsdp_version,
    "deepspeed": apply_deepspeed,
    "plugins": _plugins,
    "activation_offloading": _activation_offloading,
    **{key: _kernel_switch for key in _KERNEL_SWITCHES},
    **{key: _expert_kernels for key in _EXPERT_KERNELS},
}
