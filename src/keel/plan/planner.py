"""`plan_run`: every option a run could train with, the recommendation, what would fit.

Reads the run config and the model's config.json only: no weights, tokenizer or data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from keel.config import RunConfig
from keel.distributed.strategy import STRATEGIES, Strategy, configured_strategy
from keel.errors import KeelError, ModelError
from keel.models.attention import VARLEN_ATTENTION
from keel.models.tensor_plan import one_process_part, required_tensor_plan
from keel.models.vocabulary import (
    AddedTokens,
    configured_tokens,
    embedding_rows,
    grow_vocabulary,
    with_trained_embeddings,
)
from keel.plan.activations import Shapes
from keel.plan.architecture import build_meta_model, read_architecture
from keel.plan.census import METHODS, Census, method_variants, take_census
from keel.plan.devices import DeviceSpec
from keel.plan.estimate import Option, Workload, estimate, strategies_for
from keel.plan.generation import GenerationWork
from keel.plan.vision import VisionShapes
from keel.precision import Precision
from keel.stages.base import reference_source
from keel.stages.registry import get_stage

# train.gradient_checkpointing's values, in the order the recommendation prefers them
CHECKPOINTING = (False, True, "offload")


class DoesNotFit(KeelError):
    """The configured run needs more memory per device than the devices have."""


@dataclass
class Plan:
    """Options for one run config on `devices`, and the cheapest that fits."""

    devices: DeviceSpec
    work: Workload
    method: str  # configured
    checkpointing: bool | str  # configured: False | True | "offload"
    strategy: Strategy | None  # configured; None: auto
    options: list[Option]
    recommendation: Option | None
    censuses: dict[str, Census] = field(repr=False)
    shapes: Shapes = field(repr=False)
    # under tensor parallelism the censuses count one process's part of each layer: the
    # whole model's parameters (0: as the censuses count them)
    whole_params: int = 0

    @property
    def params(self) -> int:
        return self.censuses[self.method].params

    @property
    def trainable_params(self) -> int:
        return self.censuses[self.method].trainable_params

    def option_for(
        self, strategy: Strategy, method: str, checkpointing: bool | str
    ) -> Option | None:
        """The option with these settings, or None where it does not apply here."""
        for option in self.options:
            if (option.strategy, option.method, option.gradient_checkpointing) == (
                strategy,
                method,
                checkpointing,
            ):
                return option
        return None

    def estimate(
        self,
        strategy: Strategy,
        method: str,
        checkpointing: bool | str,
        *,
        work: Workload | None = None,
        devices: DeviceSpec | None = None,
        census: Census | None = None,
    ) -> Option:
        """An option under another workload, device count or census (for what-ifs)."""
        return estimate(
            census or self.censuses[method],
            self.shapes,
            devices or self.devices,
            work or self.work,
            strategy=strategy,
            checkpointing=checkpointing,
        )


def workload_of(
    cfg: RunConfig,
    *,
    precision: Precision,
    checkpoint_itemsize: int,
    auto_attn: str = "sdpa",
    vision: VisionShapes | None = None,
    longest_prompt: int | None = None,
) -> Workload:
    """The run's per-step work; `auto_attn` is what model.attn_implementation auto means for
    this model (sdpa or eager: flash-attn on the target machine cannot be known here, and
    sdpa's estimate is the larger; under train.padding_free a text model runs keel's varlen
    attention instead). `vision`: a vision-language model's encoder and image
    sizes (one image per sequence assumed: the plan reads no data). A prompt stage (grpo)
    generates: each row trains as num_generations sequences (keel.plan.generation), of its
    prompt (`longest_prompt` tokens when the prepared data is known, else up to
    data.cutoff_len) and a completion."""
    attn = cfg.model.attn_implementation
    attn = auto_attn if attn == "auto" else attn
    stage = get_stage(cfg.train.stage)
    generation = None
    if stage.unit == "prompt":  # answered online: each prompt trains as a group of sequences
        generation = _generation_work(stage.name, cfg.stage_settings)
    group = generation.num_generations if generation else 1
    sequences = cfg.train.micro_batch_size * stage.sequences_per_row * group
    several = cfg.data.packing or sequences > 1  # samples in one micro-batch
    if attn == "sdpa" and cfg.train.padding_free and vision is None and several:
        # a text model's padding-free micro-batch of several samples: laid end to end and
        # attended one by one (keel.models.attention), no [T, T] mask (a vision model's
        # image tokens may attend both ways, which keeps it padded: planned as masked, the
        # larger). One sample per micro-batch runs plain sdpa either way.
        attn = VARLEN_ATTENTION
    reference = reference_source(stage, cfg.stage_settings, cfg.method.reference_by_adapters_off)
    return Workload(
        micro_batch_size=cfg.train.micro_batch_size,
        cutoff_len=min(cfg.data.cutoff_len, longest_prompt or cfg.data.cutoff_len),
        loss_chunk_size=cfg.train.loss_chunk_size,
        packing=cfg.data.packing,
        attn=attn,
        precision=precision,
        reshard_after_forward=cfg.distributed.fsdp.reshard_after_forward,
        shard_size=cfg.distributed.fsdp.shard_size,
        checkpoint_itemsize=checkpoint_itemsize,
        sequences_per_row=stage.sequences_per_row * group,
        reference_copy=reference == "copy",
        optimizer=cfg.train.optimizer,
        vision=vision,
        generation=generation,
        lm_head=stage.head == "lm",
        context_parallel=cfg.distributed.context_parallel,
    )


def _generation_work(section: str, settings) -> GenerationWork:
    """What the section of a stage that answers its prompts online (grpo) asks to generate."""
    return GenerationWork(
        section=section,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        batch_prompts=settings.generation_batch_prompts,
    )


def resolved_precision(requested: str, kind: str) -> Precision:
    """train.precision without auto: bf16 on a GPU; fp32 on a CPU (the larger estimate;
    `keel plan` measures the CPU like training does and passes the result instead)."""
    if requested != "auto":
        return Precision(requested, "set by train.precision")
    if kind == "cuda":
        return Precision("bf16", "auto: planned as bf16 on a GPU")
    return Precision("fp32", "auto: planned as fp32 on a CPU (the larger estimate)")


def plan_run(
    cfg: RunConfig,
    model_dir: Path | None = None,
    *,
    devices: DeviceSpec,
    precision: Precision | None = None,
    log: Callable[[str], None] = lambda _m: None,
    longest_prompt: int | None = None,
) -> Plan:
    """Every applicable option for `cfg` on `devices`, each with its per-device bytes.

    `model_dir` holds at least a config.json (default: cfg.model.path; a bundled model
    is read from its converted folder or its GGUF header). `precision` is the resolved
    train.precision (default: resolved_precision). Builds the model on the meta device
    once per method; nothing is allocated or read besides config.json. `longest_prompt`:
    a prompt stage's (grpo) longest prepared prompt, when the data is known.
    """
    import torch

    from keel.models import torch_dtype

    arch = read_architecture(cfg, model_dir, log=log)
    dtype = torch_dtype(cfg.model.dtype) or torch.float32  # auto: fp32 master weights
    base = build_meta_model(arch, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    added = _planned_tokens(cfg, model_dir, base)
    trains_embeddings = grow_vocabulary(base, added, log=lambda _m: None)  # said in preflight
    shapes = Shapes.from_config(base.config)  # with any rows added tokens need
    whole = 0
    if (tp := cfg.distributed.tensor_parallel) > 1:  # one process's part of each layer
        devices, shapes = replace(devices, tensor_parallel=tp), _split_shapes(shapes, tp)
        whole = sum(p.numel() for p in base.parameters())
        one_process_part(base, required_tensor_plan(base, tp), tp)
    precision = precision or resolved_precision(cfg.train.precision, devices.kind)
    censuses = _censuses(base, cfg, precision, log, trains_embeddings=trains_embeddings)
    on_disk = getattr(arch, "dtype", None) or dtype
    if isinstance(on_disk, str):
        on_disk = getattr(torch, on_disk)
    work = workload_of(
        cfg,
        precision=precision,
        checkpoint_itemsize=torch.empty((), dtype=on_disk).element_size(),
        auto_attn=base.config._attn_implementation,  # built without one: transformers' choice
        vision=_vision_shapes(arch, cfg, censuses[cfg.method.type]),
        longest_prompt=longest_prompt,
    )
    options = [
        estimate(census, shapes, devices, work, strategy=strategy, checkpointing=ckpt)
        for strategy in strategies_for(devices)
        for census in censuses.values()
        for ckpt in checkpointing_for(devices, cfg.train.gradient_checkpointing)
    ]
    return Plan(
        devices=devices,
        work=work,
        method=cfg.method.type,
        checkpointing=cfg.train.gradient_checkpointing,
        strategy=configured_strategy(
            cfg.distributed.strategy,
            cpu_offload=cfg.distributed.fsdp.cpu_offload,
            dp_size=devices.dp_size,
            cuda=devices.kind == "cuda",
            tensor_parallel=devices.tensor_parallel,
        ),
        options=options,
        recommendation=recommend(options, cfg.method.type),
        censuses=censuses,
        shapes=shapes,
        whole_params=whole,
    )


def _split_shapes(shapes: Shapes, size: int) -> Shapes:
    """The sizes one process of a tensor-parallel group computes inside a layer: its heads
    and its MLP columns (the hidden size, the layers and the vocabulary stay whole)."""
    return replace(
        shapes,
        intermediate=shapes.intermediate // size,
        heads=shapes.heads // size,
        kv_heads=shapes.kv_heads // size,
    )


def _vision_shapes(arch, cfg: RunConfig, census: Census) -> VisionShapes | None:
    """A vision-language model's encoder and image sizes at model.vision.image_max_pixels."""
    if not census.is_vision:
        return None
    return VisionShapes.of(arch, cfg.model.vision.image_max_pixels, census.projector_width)


def checkpointing_for(devices: DeviceSpec, configured: bool | str) -> tuple[bool | str, ...]:
    """The checkpointing choices to weigh: off and on; offload on GPUs (on a CPU it is
    plain checkpointing, so only when configured)."""
    if devices.kind == "cuda" or configured == "offload":
        return CHECKPOINTING
    return CHECKPOINTING[:2]


def _planned_tokens(cfg: RunConfig, model_dir: Path | None, base) -> AddedTokens | None:
    """What model.add_tokens / add_special_tokens add: exactly, from the tokenizer beside
    config.json; without one, every token as new (the most rows they can need)."""
    count = len(cfg.model.add_tokens) + len(cfg.model.add_special_tokens)
    if not count:
        return None
    folder = Path(model_dir or cfg.model.path).expanduser()
    if folder.is_dir():
        try:
            return configured_tokens(folder, cfg.model)
        except ModelError:
            pass
    rows = embedding_rows(base)
    return AddedTokens(new_ids=tuple(range(rows, rows + count)), known=rows, size=rows + count)


def _censuses(
    base, cfg: RunConfig, precision: Precision, log, *, trains_embeddings: bool
) -> dict[str, Census]:
    variants = method_variants(cfg.method)
    if cfg.distributed.tensor_parallel > 1:  # QLoRA's and OFT's layers are not split
        variants = [m for m in variants if m.type in ("full", "freeze", "lora")]
    if trains_embeddings:  # as training does for added tokens (keel.models.vocabulary)
        variants = [with_trained_embeddings(base, m, lambda _m: None) for m in variants]
    censuses = {}
    for index, method in enumerate(variants):
        try:
            censuses[method.type] = take_census(
                base,
                method,
                copy_first=index < len(variants) - 1,
                precision=precision,
                vision=cfg.model.vision,
            )
        except ModelError as exc:
            if method.type == cfg.method.type:
                raise
            log(f"plan: method {method.type} left out: {exc}")
    return censuses


def _method_rank(method: str, configured: str) -> int:
    return 0 if method == configured else 1 + METHODS.index(method)


def recommend(options: list[Option], method: str) -> Option | None:
    """The cheapest option that fits: the configured method if any of its options fits
    (else full, lora, freeze, then qlora, which changes the numerics), then fewer moving
    parts (single < ddp < fsdp < fsdp_offload), checkpointing last (off < on < offload)."""
    fitting = [o for o in options if o.fits]
    return min(
        fitting,
        default=None,
        key=lambda o: (
            _method_rank(o.method, method),
            STRATEGIES.index(o.strategy),
            CHECKPOINTING.index(o.gradient_checkpointing),
        ),
    )


def changes(plan: Plan, option: Option) -> list[str]:
    """The config overrides that turn the configured run into `option`."""
    out = []
    if option.strategy != plan.strategy and option.strategy is not Strategy.SINGLE:
        out.append(f"distributed.strategy={option.strategy.config_value}")
        offload = option.strategy is Strategy.FSDP_OFFLOAD
        if offload != (plan.strategy is Strategy.FSDP_OFFLOAD):
            out.append(f"distributed.fsdp.cpu_offload={str(offload).lower()}")
    if option.method != plan.method:
        out.append(f"method.type={option.method}")
    if option.gradient_checkpointing != plan.checkpointing:
        out.append(f"train.gradient_checkpointing={str(option.gradient_checkpointing).lower()}")
    return out


def knob_changes(plan: Plan, option: Option) -> list[tuple[str, Option]]:
    """From `option`, the changes besides strategy and method that would make it fit (or
    the furthest each can go): offloaded checkpointing on a GPU, bf16 frozen weights under
    LoRA, a smaller micro-batch, a shorter cutoff length, more nodes."""
    found = []
    work = plan.work
    census = plan.censuses[option.method]
    if option.gradient_checkpointing != "offload" and plan.devices.kind == "cuda":
        found.append(
            (
                "train.gradient_checkpointing=offload (layer inputs in host memory)",
                plan.estimate(option.strategy, option.method, "offload"),
            )
        )
    if option.method in ("lora", "qlora") and census.param_itemsize == 4:
        found.append(
            (
                "model.dtype=bfloat16 (frozen weights in bf16, adapters stay fp32)",
                plan.estimate(
                    option.strategy,
                    option.method,
                    option.gradient_checkpointing,
                    census=census.with_frozen_itemsize(2),
                ),
            )
        )
    steps = [
        ("train.micro_batch_size", "micro_batch_size", _halvings(work.micro_batch_size, 1)),
        ("data.cutoff_len", "cutoff_len", _halvings(work.cutoff_len, 128)),
    ]
    for key, name, values in steps:
        tried = _furthest(plan, option, [(v, replace(work, **{name: v})) for v in values])
        if tried is not None:
            found.append((f"{key} {getattr(work, name)} -> {tried[0]}", tried[1]))
    found += _generation_knobs(plan, option)
    # More devices shrink FSDP2's shards; offloaded state is in host memory already, and
    # more CPU processes on one node share the same RAM.
    single_gpu = option.strategy is Strategy.SINGLE and plan.devices.kind == "cuda"
    if option.strategy is Strategy.FSDP or single_gpu:
        found.append(more_devices(plan, option.method, option.gradient_checkpointing))
    return found


def _generation_knobs(plan: Plan, option: Option) -> list[tuple[str, Option]]:
    """A generating stage's own changes: fewer prompts generated at once (a smaller KV
    cache, the same samples), then shorter completions; each as far as it must go."""
    generation = plan.work.generation
    if generation is None:
        return []
    steps = [
        ("generation_batch_prompts", "batch_prompts", _halvings(generation.batch_prompts, 1)),
        (
            "max_completion_length",
            "max_completion_length",
            _halvings(generation.max_completion_length, 32),
        ),
    ]
    found = []
    for key, name, values in steps:
        works = [
            (v, replace(plan.work, generation=replace(generation, **{name: v}))) for v in values
        ]
        tried = _furthest(plan, option, works)
        if tried is not None:
            change = f"{generation.section}.{key} {getattr(generation, name)} -> {tried[0]}"
            found.append((change, tried[1]))
    return found


def _furthest(
    plan: Plan, option: Option, works: list[tuple[int, Workload]]
) -> tuple[int, Option] | None:
    """`option` under each (value, workload) in turn: the first that fits, else the last
    tried (the furthest the change can go); None when there is nothing to try."""
    tried = None
    for value, work in works:
        tried = (
            value,
            plan.estimate(option.strategy, option.method, option.gradient_checkpointing, work=work),
        )
        if tried[1].fits:
            break
    return tried


def more_devices(plan: Plan, method: str, checkpointing: bool | str) -> tuple[str, Option]:
    """FSDP2 on twice the devices, then four times, ... up to 64 times: the first count
    that fits, or the last. GPUs fill a node up to 8 before more nodes are added."""
    devices = plan.devices
    for k in range(1, 7):
        world = devices.world * 2**k
        per_node = min(world, max(devices.per_node, 8))
        more = devices.with_world(per_node=per_node, nodes=world // per_node)
        tried = plan.estimate(Strategy.FSDP, method, checkpointing, devices=more)
        if tried.fits:
            break
    flags = f"--gpus {more.per_node}" + (f" --nodes {more.nodes}" if more.nodes > 1 else "")
    return (f"fsdp on {more.world} devices ({flags})", tried)


def _halvings(start: int, floor: int) -> list[int]:
    values = []
    while start // 2 >= floor:
        start //= 2
        values.append(start)
    return values
