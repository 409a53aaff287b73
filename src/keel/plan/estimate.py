"""Per-device memory of every (strategy, method, checkpointing) option, and the pick.

Per device, for one micro-batch of micro_batch_size x cutoff_len tokens:
- params: every weight (tied ones once) and buffer at its dtype; under FSDP2 this rank's
  shard of each weight, padded to an even split (ceil(rows / dp) rows), buffers whole;
- grads: the trainable weights' (padded shards under FSDP2; DDP's gradient buckets);
- optimizer: AdamW's two moments per trainable weight, in the weight's dtype (fp32 master
  weights with model.dtype auto), unpadded shards under FSDP2, plus a 4-byte step each;
  train.optimizer adamw_8bit / adamw_4bit: torchao's block-quantised moments where it
  quantises them (keel.quant.optim_state); muon: a momentum buffer and a step per weight
  matrix Muon steps, AdamW's state for the rest (the step's transient, one matrix's
  update whole with its bf16 iterates, is less than a step's activations: not counted);
- activations, logits: see keel.plan.activations;
- buffers: FSDP2's gathered units in the compute dtype (the root, which stays gathered
  through backward, plus the largest two neighbouring units: the running one and the
  prefetched one; every unit with reshard_after_forward off), the root's unsharded
  gradients (reduced at the end of backward) and, for the largest unit, its unsharded
  gradients plus the fp32 reduce-scatter input; or
  autocast's weight copies without FSDP;
- generation: what a generating stage (grpo) holds while it generates, before it trains:
  KV cache, logits row, FSDP2's unsharded replica (keel.plan.generation);
- overhead: the process's fixed cost (keel.plan.devices).
A vision-language model's tower and projector are replicated on every rank under every
strategy (their weights, and when they train their gradients and AdamW state, whole), and
its images add the vision side's activations (keel.plan.vision).
fsdp_offload keeps params, grads and optimizer state in host memory (GPUs only).
Checkpointing is off (False), on (True) or "offload" (train.gradient_checkpointing's
values): offload keeps the checkpointed blocks' inputs in host memory on a GPU, and is
plain checkpointing on a CPU. QLoRA's NF4 weights: keel.plan.census.

The total is the step's peak, not the sum of the components: the loss's peak (logits),
a checkpointed block's recomputation (part of activations) and FSDP2's gradient buffers
come at different times in backward, and gradients appear as backward frees activations
(except DDP's buckets, which exist throughout); see `_moving_peak`. Generation comes
before training, so the step's peak is the larger of the two phases. Checked against
`keel train` on this CPU in benchmarks/plan_accuracy.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from keel.distributed.strategy import Strategy
from keel.plan.activations import (
    Regime,
    Saved,
    Shapes,
    activation_bytes,
    autocast_copy_bytes,
    experts_transient_bytes,
    loss_bytes,
)
from keel.plan.adapter_memory import dora_transient_bytes
from keel.plan.census import ADAPTER_METHODS, ROOT, Census
from keel.plan.devices import DeviceSpec
from keel.plan.generation import GenerationBytes, GenerationWork, generation_bytes
from keel.plan.vision import (
    PROJECTOR,
    TOWER,
    VisionShapes,
    VisionTraining,
    vision_activation_bytes,
)
from keel.precision import Precision
from keel.quant.optim_state import STEP_BYTES, adamw_state_bytes

COMPONENTS = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "logits",
    "buffers",
    "generation",
    "overhead",
)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one step computes, from the run config."""

    micro_batch_size: int
    cutoff_len: int
    loss_chunk_size: int
    packing: bool
    attn: str  # sdpa | eager | flash_attention_2 | keel_sdpa_varlen (padding-free rows)
    precision: Precision  # train.precision, resolved
    reshard_after_forward: bool
    checkpoint_itemsize: int  # bytes per element of the weights on disk
    # Preference stages: a DPO/ORPO/SimPO row is a pair, two sequences of up to cutoff_len
    sequences_per_row: int = 1
    # DPO/KTO with a live reference and full or freeze: a frozen copy of the weights
    reference_copy: bool = False
    optimizer: str = "adamw"  # train.optimizer: adamw | adamw_8bit | adamw_4bit | muon
    # distributed.fsdp.shard_size: FSDP2 shards over groups of this many processes (HSDP),
    # 0 over all
    shard_size: int = 0
    # A vision-language model: its encoder's sizes and one image's cost (None: text)
    vision: VisionShapes | None = None
    images_per_sequence: int = 1  # assumed: the plan reads no data
    # A generating stage (grpo): each row is a prompt, trained as sequences_per_row
    # (num_generations) completions of up to cutoff_len + max_completion_length tokens
    generation: GenerationWork | None = None
    # The loss runs the LM head (logits over the vocabulary); False: a score head of one
    # output (rm), whose logits and gradient are negligible
    lm_head: bool = True
    # distributed.context_parallel: a micro-batch's tokens split over this many processes
    context_parallel: int = 1

    @property
    def seq_len(self) -> int:
        """Tokens of one trained sequence at most: the prompt's plus a completion's."""
        extra = self.generation.max_completion_length if self.generation else 0
        return self.cutoff_len + extra

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch that one process computes (its part, under context
        parallelism: attention's exchanged heads hold as many elements as its tokens)."""
        whole = self.micro_batch_size * self.seq_len * self.sequences_per_row
        return -(-whole // self.context_parallel)

    @property
    def images(self) -> int:
        """Images in one micro-batch (0 for a text model)."""
        if self.vision is None:
            return 0
        return self.micro_batch_size * self.sequences_per_row * self.images_per_sequence


@dataclass(frozen=True)
class Breakdown:
    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    generation: int
    overhead: int
    total: int

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (*COMPONENTS, "total")}


@dataclass(frozen=True)
class Option:
    strategy: Strategy
    method: str  # full | freeze | lora | qlora | oft
    gradient_checkpointing: bool | str  # False | True | "offload"
    per_device: Breakdown
    host_bytes: int  # host RAM of one process: loading, plus offloaded state
    fits: bool
    generation: GenerationBytes | None = None  # a generating stage's terms (in per_device)


def shard_degree(devices: DeviceSpec, work: Workload) -> int:
    """How many processes one sharded copy spans: distributed.fsdp.shard_size (HSDP), else
    every data-parallel process."""
    return min(work.shard_size or devices.dp_size, devices.dp_size)


def strategies_for(devices: DeviceSpec) -> tuple[Strategy, ...]:
    """One device: no wrapper. Several: DDP, FSDP2, and FSDP2 + CPU offload on GPUs; under
    tensor parallelism FSDP2 only (keel.distributed.tensor_parallel)."""
    if devices.tensor_parallel > 1:
        fsdp = (Strategy.FSDP, Strategy.FSDP_OFFLOAD)
        return fsdp if devices.kind == "cuda" else fsdp[:1]
    if devices.dp_size == 1:
        return (Strategy.SINGLE,)
    if devices.kind == "cuda":
        return (Strategy.DDP, Strategy.FSDP, Strategy.FSDP_OFFLOAD)
    return (Strategy.DDP, Strategy.FSDP)


def state_bytes(
    census: Census,
    strategy: Strategy,
    dp_size: int,
    rank: int = 0,
    *,
    optimizer: str = "adamw",
    tensors: list | None = None,
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes rank `rank` allocates; exact, see tests/distributed
    (and tests/unit/test_plan_optimizer.py for train.optimizer's 8/4-bit moments).
    `tensors`: only these of the census's."""
    sharded = Strategy(strategy).shards
    params = grads = state = 0
    for t in tensors if tensors is not None else census.tensors:
        held = t.shard_bytes(dp_size, rank) if sharded else t.nbytes
        params += held
        if t.trainable:
            grads += held
            # exp_avg, exp_avg_sq (of the unpadded shard, which torchao also quantises by)
            # and the step (an fp32 scalar)
            moment = t.shard_bytes(dp_size, rank, padded=False) if sharded else t.nbytes
            if optimizer == "muon" and t.matrix:  # a momentum buffer and the step
                state += moment + STEP_BYTES
            else:
                state += adamw_state_bytes(optimizer, moment // t.itemsize, t.itemsize)
    return params, grads, state


def _saved_activations(census, shapes, devices, work, regime, checkpointing: bool | str):
    """The activations a step keeps for backward: the language model's, plus the image
    tokens' and the vision encoder's for a vision-language model."""
    saved = activation_bytes(
        census,
        shapes,
        regime,
        tokens=work.tokens,
        seq=work.seq_len,
        checkpointing=bool(checkpointing),
        packed=work.packing,
        attn=work.attn,
        offload=checkpointing == "offload" and devices.kind == "cuda",
    )
    if work.vision is None:
        return saved
    return _with_vision(
        saved, census, work, regime, hidden=shapes.hidden, checkpointing=bool(checkpointing)
    )


def estimate(
    census: Census,
    shapes: Shapes,
    devices: DeviceSpec,
    work: Workload,
    *,
    strategy: Strategy,
    checkpointing: bool | str,
) -> Option:
    """The per-device bytes of one option (see the module docstring)."""
    strategy = Strategy(strategy)
    mixed = strategy.shards and work.precision.autocast_dtype is not None
    regime = Regime.of(
        precision=work.precision,
        param_itemsize=census.param_itemsize,
        fsdp_mixed=mixed,
        cpu=devices.kind == "cpu",
    )
    params, grads, optimizer, host_state = _state(census, devices, work, strategy)
    saved = _saved_activations(census, shapes, devices, work, regime, checkpointing)
    gathered = regime.compute if mixed else census.param_itemsize
    logits = _logits(census, shapes, regime, work, gathered)
    if strategy.shards:
        always, early, late = _fsdp_step_buffers(census, shapes, devices, work, gathered)
    else:
        always = autocast_copy_bytes(census, shapes, regime, checkpointing=bool(checkpointing))
        early, late = _replica_early_grads(census, shapes, work, strategy, grads), 0
    buffers, overhead = always + late, devices.overhead_bytes
    generation = _generation(census, shapes, devices, work, strategy, gathered)
    # DoRA's moment in forward comes before the loss's (and again in backward's recompute);
    # NF4 experts are dequantised in forward and in backward, which always recomputes them
    experts = experts_transient_bytes(census)
    moment = max(dora_transient_bytes(census), experts)
    recompute = max(moment if checkpointing else 0, experts)
    peak = _moving_peak(
        grads, saved, max(logits, moment), always=always, early=early, late=late + recompute
    )
    if generation is not None:  # before training; DDP's buckets outlive zero_grad
        peak = max(peak, generation.total + (grads if strategy.replicates else 0))
    generated = generation.total if generation else 0
    total = params + optimizer + overhead + peak
    breakdown = Breakdown(
        params, grads, optimizer, saved.peak, logits, buffers, generated, overhead, total
    )
    host = devices.host_baseline_bytes + _read_buffer(
        census, work, shard_degree(devices, work), strategy.shards
    )
    host += host_state + saved.host + (params if devices.kind == "cpu" else 0)
    return Option(
        strategy,
        census.method,
        checkpointing,
        breakdown,
        host,
        total <= devices.usable_bytes,
        generation,
    )


def _logits(census: Census, shapes: Shapes, regime: Regime, work: Workload, gathered: int) -> int:
    """The loss's peak through the LM head (keel.plan.activations.loss_bytes); 0 for a
    score head of one output (rm), whose logits and weight gradient are negligible."""
    if not work.lm_head:
        return 0
    return loss_bytes(
        census,
        shapes,
        regime,
        tokens=work.tokens,
        chunk=work.loss_chunk_size,
        head_grad_itemsize=gathered,
    )


def _generation(
    census: Census,
    shapes: Shapes,
    devices: DeviceSpec,
    work: Workload,
    strategy: Strategy,
    gathered: int,
) -> GenerationBytes | None:
    """The generation phase's terms (keel.plan.generation), or None for a stage that
    trains on its dataset's rows as they are."""
    if work.generation is None:
        return None
    return generation_bytes(
        census,
        shapes,
        work.generation,
        prompt_len=work.cutoff_len,
        itemsize=gathered,
        sharded_over=shard_degree(devices, work) if strategy.shards else None,
    )


def _with_vision(
    saved: Saved,
    census: Census,
    work: Workload,
    regime: Regime,
    *,
    hidden: int,
    checkpointing: bool,
) -> Saved:
    """`saved` plus what the micro-batch's images keep for backward (keel.plan.vision)."""
    training = VisionTraining(
        tower=census.part_params(TOWER, trainable_only=True) > 0,
        projector=census.part_params(PROJECTOR, trainable_only=True) > 0,
        checkpointing=checkpointing,
        compute=regime.compute,
        hidden=hidden,
    )
    extra = vision_activation_bytes(work.vision, work.images, training)
    if work.context_parallel > 1:
        # each process embeds the whole row (keel.models.attention.embed_whole_row), and
        # its part, a view the first block keeps, keeps the whole row's embeddings alive
        extra += work.tokens * work.context_parallel * regime.residual * hidden
    return replace(saved, kept=saved.kept + extra)


def _state(
    census: Census, devices: DeviceSpec, work: Workload, strategy: Strategy
) -> tuple[int, int, int, int]:
    """(params, grads, optimizer) bytes on the device, and the bytes fsdp_offload moves to
    host memory instead (all three of them, except a vision tower's and projector's: they
    are in no FSDP unit, so they stay on the device)."""
    shards = shard_degree(devices, work)
    params, grads, optimizer = state_bytes(census, strategy, shards, optimizer=work.optimizer)
    if work.reference_copy and census.method not in ADAPTER_METHODS:  # an adapter's: its base
        params *= 2
    if strategy is Strategy.FSDP_OFFLOAD:
        kept = [t for t in census.tensors if t.replicated]
        on_device = state_bytes(census, strategy, shards, optimizer=work.optimizer, tensors=kept)
        if work.reference_copy and census.method not in ADAPTER_METHODS:
            on_device = (2 * on_device[0], *on_device[1:])
        return (*on_device, params + grads + optimizer - sum(on_device))
    return params, grads, optimizer, 0


def _head_numel(census: Census, shapes: Shapes) -> int:
    """The trainable output layer's elements (0 when it is frozen)."""
    return shapes.vocab * shapes.hidden if census.head_trainable else 0


def _fsdp_step_buffers(
    census: Census, shapes: Shapes, devices: DeviceSpec, work: Workload, gathered: int
) -> tuple[int, int, int]:
    """FSDP2's (always, early, late) buffers: gathered units throughout, the root's
    unsharded output-layer gradient at the loss once a second chunk runs, and the
    gradient buffers of backward (see `_moving_peak`)."""
    shards = shard_degree(devices, work)
    always, late = _fsdp_buffers(census, gathered, work.reshard_after_forward, shards)
    # the output layer's gradient exists at the loss
    more_chunks = work.lm_head and work.tokens > work.loss_chunk_size
    early = _head_numel(census, shapes) * gathered if more_chunks else 0  # the root's, unsharded
    return always, early, late


def _replica_early_grads(
    census: Census, shapes: Shapes, work: Workload, strategy: Strategy, grads: int
) -> int:
    """Gradients that exist at the loss without FSDP: DDP's buckets (throughout), else
    the output layer's once a second chunk runs."""
    if strategy.replicates:
        return grads
    # the output layer's gradient exists at the loss
    more_chunks = work.lm_head and work.tokens > work.loss_chunk_size
    return min(_head_numel(census, shapes) * census.param_itemsize, grads) if more_chunks else 0


def _moving_peak(
    grads: int, saved: Saved, logits: int, *, always: int, early: int, late: int
) -> int:
    """Peak of what comes and goes in a step: activations, the loss, gradients, buffers.

    Two moments bound it. At the loss, first in backward: all kept activations, the loss's
    peak and the gradients that already exist (`early`: DDP's buckets, which exist
    throughout; else the output layer's, once a second chunk runs). At the end of
    backward: every gradient, the buffers only backward needs (`late`: FSDP2's gradient
    buffers) and the first block's activations (recomputed under checkpointing). In
    between, gradients appear as backward frees activations, so the two do not add up.
    `always`: buffers present throughout (FSDP2's gathered units, autocast's copies).
    """
    at_loss = saved.kept + logits + early + always
    at_end = grads + always + late + saved.block
    return max(at_loss, at_end)


def _fsdp_buffers(
    census: Census, itemsize: int, reshard_after_forward: bool, dp_size: int
) -> tuple[int, int]:
    """(gathered, gradient) buffer bytes of FSDP2 with weights gathered at `itemsize`
    (NF4 weights gather their packed bytes)."""
    units = [*range(census.units), ROOT]
    size = {u: census.unit_gathered_bytes(u, itemsize, dp_size) for u in units}
    grads = {u: census.unit_numel(u, trainable_only=True) for u in units}
    # Units run in order (untied embeddings, then the blocks); FSDP2 prefetches the next
    # one while one runs, both ways, so two neighbours are gathered at once.
    order = [size[u] for u in range(census.units)]
    pair = max((a + b for a, b in zip(order, order[1:])), default=sum(order))
    if reshard_after_forward:
        gathered = size[ROOT] + pair
    else:
        gathered = sum(size.values())
    # The root's unsharded gradients wait for the end of backward; each other unit's exist
    # with their fp32 reduce-scatter input until its reduce-scatter.
    reduce = grads[ROOT] * itemsize + max(grads.values()) * (itemsize + 4)
    return gathered, reduce


def _read_buffer(census: Census, work: Workload, dp_size: int, sharded: bool) -> int:
    """The largest piece of one checkpoint tensor read at once (a shard's rows under FSDP)."""
    largest = 0
    for t in census.tensors:
        if t.buffer:
            continue
        rows = -(-t.shape[0] // dp_size) if sharded and t.shape and not t.replicated else None
        numel = math.prod(t.shape) if rows is None else rows * math.prod(t.shape[1:])
        largest = max(largest, numel * work.checkpoint_itemsize)
    return largest
