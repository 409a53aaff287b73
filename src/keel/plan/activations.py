"""Bytes a training step keeps for backward, derived for a Llama-style decoder block.

The block (Llama, Qwen2, Mistral, SmolLM, ...) is RMSNorm -> attention (q/k/v/o
projections, rotary embeddings, sdpa) -> residual add -> RMSNorm -> SwiGLU MLP
(down(silu(gate(x)) * up(x))) -> residual add. Per token and per block, autograd saves
(h hidden size, i intermediate size, a heads, kv = kv_heads x head_dim, q = a x head_dim;
c bytes of the compute dtype, r of the residual stream and of a norm's output; r = 4 with
fp32 master weights even under bf16 autocast, r = c under FSDP2 mixed precision):

- each RMSNorm: its input upcast to fp32 (4h, saved by pow and mul) plus the normalised
  tensor (r h) when the norm weight trains (the weight's gradient needs it);
- sdpa (flash / memory-efficient kernels): q (c q), k and v (c kv each; c q each when a
  packing mask switches off sdpa's grouped-query path and k/v are repeated), the output
  (c q; the o_proj input shares its storage), the log-sum-exp (4a); with packing, the
  [B, 1, s, s] additive mask (s c per token, one per block);
- SwiGLU: gate output, silu(gate), up output (3 c i); the product is down_proj's input;
- a linear's input, when its weight trains or LoRA wraps it (a frozen weight needs only
  itself for the input's gradient): q/k/v share one input and gate/up another (r h
  once), unless autocast casts it per call (c h per linear: fp32 weights, bf16 compute);
  the SwiGLU product (c i) for down_proj. LoRA adds its rank-r intermediate (c r); it
  reads its own copy (c) of the input when the input is not in the adapters' dtype
  (fp32 adapters on a bf16 base) or with dropout, plus the dropout mask (1 byte on CUDA,
  a noise tensor in the adapters' dtype on CPU); OFT keeps its input for the rotation's
  gradient (its own copy, c, when cast to the compute dtype) and none for the frozen
  weight it feeds;
- rotary embeddings save only the shared cos/sin tables (2 x 4 x head_dim per token).

Full fine-tuning in fp32 (c = r = 4), for example: 2 (4h + 4h) + (4q + 8kv + 4q + 4a) +
12i + (4h + 4h + 4i) = 32h + 8kv + 16i + 4a bytes per token per block (q = h), i.e.
44.6 KB for SmolLM2-135M (h 576, kv 192, i 1536, a 9): 1.3 GB for 30 blocks x 1024 tokens.

Without gradient checkpointing every block in the gradient's path keeps all of that;
with it (non-reentrant, per block) each keeps only its input (r h) and one block's full
set exists at a time, while backward recomputes it. Blocks before the first trainable
parameter (freeze) keep nothing, and the first block after frozen embeddings keeps no
input for its first norm. Outside the blocks: the final norm, the hidden states at target
positions (r h), the cos/sin tables and the batch.

Checked against autograd's saved tensors on random Llama models, within 2%, in
tests/unit/test_plan_activations.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from keel.models.attention import VARLEN_ATTENTION
from keel.plan.adapter_memory import dora_weight_copies, expert_lora_weights, oft_rotations
from keel.plan.census import Census, LayerInfo, LinearInfo
from keel.plan.qat import qat_per_token, qat_weight_bytes
from keel.precision import Precision

# Linears that read the same tensor: q/k/v read the first norm's output, gate/up the
# second's. o_proj reads sdpa's output (saved by sdpa already); down_proj the SwiGLU
# product. Other names (fused qkv_proj, ...) are taken to read a norm output alone.
_INPUT_GROUP = {
    "q_proj": "attn_in",
    "k_proj": "attn_in",
    "v_proj": "attn_in",
    "o_proj": "attn_out",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
    "down_proj": "mlp_out",
}
_BATCH_BYTES_PER_TOKEN = 40  # input_ids, targets, position_ids (int64), masks, indices
# Config attributes of heads that post-process the logits; keel's objective then takes
# the full Hugging Face forward instead of its chunked loss.
_HEAD_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


@dataclass(frozen=True)
class Shapes:
    """The architecture's sizes (from config.json, with Llama-style attribute names)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    plain_head: bool = True  # logits = output_layer(hidden), so keel's chunked loss applies
    experts_per_token: int = 0  # a mixture of experts: the experts each token goes through

    @classmethod
    def from_config(cls, config) -> Shapes:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = text.hidden_size
        heads = text.num_attention_heads
        return cls(
            hidden=hidden,
            intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or hidden // heads,
            layers=text.num_hidden_layers,
            vocab=text.vocab_size,
            plain_head=all(
                getattr(text, name, None) in (None, 1.0) for name in _HEAD_POSTPROCESSING
            ),
            experts_per_token=getattr(text, "num_experts_per_tok", None) or 0,
        )


@dataclass(frozen=True)
class Regime:
    """Dtypes of a step's tensors (bytes per element)."""

    compute: int  # matmul outputs: 2 under bf16/fp16, 4 in fp32
    residual: int  # the residual stream, which follows the (gathered) weights' dtype
    cast_inputs: bool  # autocast casts fp32 activations per linear (one copy each)
    weight_copies: bool  # autocast casts fp32 weights to the compute dtype
    cpu: bool  # dropout keeps a noise tensor (CPU) instead of a bool mask (CUDA)
    adapters: int = 0  # LoRA weights' bytes as computed with; 0: as stored (census)

    @classmethod
    def of(
        cls, *, precision: Precision, param_itemsize: int, fsdp_mixed: bool, cpu: bool
    ) -> Regime:
        """`fsdp_mixed`: FSDP2 gathers the weights (adapters too) in the compute dtype."""
        compute = precision.compute_itemsize
        residual = compute if fsdp_mixed else param_itemsize
        low = compute < residual
        return cls(
            compute=compute,
            residual=residual,
            cast_inputs=low,
            weight_copies=low,
            cpu=cpu,
            adapters=compute if fsdp_mixed else 0,
        )


def grad_path(census: Census) -> list[bool]:
    """Per block: does the gradient pass through it (a trainable parameter in or before)?"""
    flows, out = census.embeddings_trainable, []
    for layer in census.layers:
        flows = flows or layer.has_trainable
        out.append(flows)
    return out


def block_bytes_per_token(
    layer: LayerInfo,
    shapes: Shapes,
    regime: Regime,
    *,
    seq: int,
    packed: bool,
    attn: str,
    grad_in: bool = True,
    qat: tuple[str, int] | None = None,
) -> int:
    """Bytes one block saves for backward, per token (see the module docstring).

    `grad_in`: the block's input needs a gradient (something before it trains). When not
    (the first block under LoRA or freeze), its first norm keeps no input and the
    attention projections' dropout keeps no mask.
    """
    h, c, r = shapes.hidden, regime.compute, regime.residual
    widths = {
        "h": h,
        "q": shapes.heads * shapes.head_dim,
        "kv": shapes.kv_heads * shapes.head_dim,
    }
    inputs = layer.norm_inputs or ("h",) * len(layer.norm_trainable)
    norms = sum(
        (4 + (r if trains else 0)) * widths[kind]
        for trains, kind in zip(layer.norm_trainable, inputs)
    )
    if not grad_in and layer.norm_trainable:
        norms -= 4 * h
    # OFT returns its layer's output in its input's dtype: the residual's, not autocast's
    mlp_dtype = r if _oft_reads(layer, "mlp_in") else c
    mlp = (
        3 * mlp_dtype * shapes.intermediate
        if layer.experts is None
        else _moe(layer, shapes, regime)
    )
    return (
        norms
        + _attention(shapes, c, seq=seq, packed=packed, attn=attn)
        + mlp
        + _linear_inputs(layer, shapes, regime, grad_in=grad_in, attn=attn)
        + (qat_per_token(layer, regime, qat) if qat else 0)
    )


def _moe(layer: LayerInfo, shapes: Shapes, regime: Regime) -> int:
    """A mixture-of-experts MLP per token (transformers 5's fused experts, grouped matmuls):
    the router's fp32 softmax (4 E), the top-k indices and weights (36 k: int64 copies for
    sorting and scattering), and per expert a token goes through: its gate_up output (2 w),
    the SwiGLU activation (w) and each expert's output (h); with the experts' weights
    training also the gathered input (h) and the product down_proj reads (w). Grouped
    matmuls are not autocast ops: the experts compute in their weights' dtype (r). The
    router keeps its input when its weight trains (autocast: a copy in c), and under
    autocast its logits (c E). A shared expert (Linear modules beside the routed ones)
    adds its own SwiGLU outputs."""
    experts, k = layer.experts, shapes.experts_per_token or 1
    h, c, r, w = shapes.hidden, regime.compute, regime.residual, experts.width
    weights_grad = experts.trainable or experts.lora_numel  # LoRA's gradient passes W + BA
    per_expert = r * (3 * w + h) + (r * (h + w) if weights_grad else 0)
    if experts.nf4_itemsize:  # recomputed in backward: its input, top-k ids and weights
        per_expert, total = 8 + r, r * h
    else:
        total = 0
    total += 4 * experts.count + 36 * k + k * per_expert
    total += c * experts.count if regime.cast_inputs else 0
    if experts.router_trainable:
        total += (c if regime.cast_inputs else r) * h
    shared = [m.in_features for m in layer.linears if m.name == "down_proj"]
    return total + sum(3 * c * width for width in shared)


def _attention(shapes: Shapes, c: int, *, seq: int, packed: bool, attn: str) -> int:
    q = shapes.heads * shapes.head_dim
    kv = shapes.kv_heads * shapes.head_dim
    # transformers' sdpa separates packed samples with a [T, T] mask; flash_attention_2 and
    # keel's varlen attention (padding-free micro-batches) attend per sample, unmasked
    masked = packed and attn == "sdpa"
    repeated = attn == "eager" or (masked and shapes.kv_heads < shapes.heads)
    total = c * q + 2 * c * (q if repeated else kv) + c * q + 4 * shapes.heads
    if masked:
        total += seq * c
    if attn == "eager":  # the attention probabilities, fp32 softmax output and its cast
        total += shapes.heads * seq * (4 + c)
    return total


def _linear_inputs(
    layer: LayerInfo, shapes: Shapes, regime: Regime, *, grad_in: bool, attn: str
) -> int:
    groups: dict[str, list[LinearInfo]] = {}
    for linear in layer.linears:
        groups.setdefault(_INPUT_GROUP.get(linear.name, linear.name), []).append(linear)
    total = 0
    for group, members in groups.items():
        # A norm output is in the residual dtype (times an fp32 or gathered weight); the
        # attention output and the SwiGLU product are already in the compute dtype.
        x = regime.compute if group in ("attn_out", "mlp_out") else regime.residual
        if group == "mlp_out" and _oft_reads(layer, "mlp_in"):
            x = regime.residual  # the product of OFT outputs, in their input's dtype
        total += _group_bytes(
            members,
            members[0].in_features,
            x,
            regime,
            # sdpa's output is the output projection's input; keel's varlen attention
            # saves each sample's output and joins them into a new tensor
            shared=group == "attn_out" and attn != VARLEN_ATTENTION,
            masks=grad_in or group != "attn_in",
        )
    return total


def _group_bytes(
    members: list[LinearInfo], width: int, x: int, regime: Regime, *, shared: bool, masks: bool
) -> int:
    """Inputs saved by the linears reading one tensor `x` bytes wide per element.

    Readers of `x` itself share one saved copy; a reader gets its own copy when autocast
    casts per call, or when LoRA casts `x` to its fp32 adapters (a bf16 base) or masks it
    (dropout: plus the mask, in the adapters' dtype on a CPU). `shared`: `x` is saved by
    another op already (sdpa's output).
    """
    c = regime.compute
    cast = regime.cast_inputs and x != c
    total, readers = 0, 0
    for m in members:
        if m.oft_block:  # the input (blocks first: a view) for the rotation's gradient
            # PEFT casts it to the rotation's dtype, autocast then to the compute dtype:
            # a copy unless all three agree
            rotation = regime.adapters or m.oft_itemsize
            own = x != rotation or c != rotation
            total += c * width if own else 0
            readers += not own
        elif m.lora_rank:
            # PEFT casts x to the adapters' dtype, then applies dropout, then lora_A.
            adapter = regime.adapters or m.lora_itemsize
            own = cast or m.lora_dropout or adapter != x
            total += c * m.lora_rank + (c * width if own else 0)
            readers += not own
            if m.lora_dropout and masks:
                total += (adapter if regime.cpu else 1) * width
            # DoRA scales the base and the LoRA outputs by the magnitude: both are saved
            total += 2 * c * m.dora_features
        elif m.trainable:
            total += c * width if cast else 0
            readers += not cast
    return total + (x * width if readers and not shared else 0)


@dataclass(frozen=True)
class Saved:
    """Bytes saved for backward by one micro-batch."""

    kept: int  # through all of forward and into backward (on the device)
    block: int  # one block's full set (recomputed in backward under checkpointing)
    checkpointing: bool
    host: int = 0  # offloaded checkpointing: the blocks' saved inputs, in pinned host memory

    @property
    def peak(self) -> int:
        """The most saved at once: everything kept, plus one recomputed block."""
        return self.kept + (self.block if self.checkpointing else 0)


def activation_bytes(
    census: Census,
    shapes: Shapes,
    regime: Regime,
    *,
    tokens: int,
    seq: int,
    checkpointing: bool,
    packed: bool,
    attn: str,
    offload: bool = False,
) -> Saved:
    """What one micro-batch of `tokens` tokens (`seq` per row) saves for backward.

    `offload` (with `checkpointing`; keel.models.offload): the inputs the checkpointed
    blocks keep wait in pinned host memory, except the one block's being recomputed. The
    pinned allocator rounds each to a power of two (and caches the blocks).
    """
    h, r = shapes.hidden, regime.residual
    flows = grad_path(census)
    into = [census.embeddings_trainable, *flows[:-1]]  # does a gradient reach its input?
    blocks = [
        block_bytes_per_token(
            layer,
            shapes,
            regime,
            seq=seq,
            packed=packed,
            attn=attn,
            grad_in=grad_in,
            qat=census.qat,
        )
        for layer, flow, grad_in in zip(census.layers, flows, into)
        if flow
    ]
    per_token = len(blocks) * r * h if checkpointing else sum(blocks)
    if any(flows) or census.head_trainable:
        per_token += 4 * h + (r * h if census.final_norm_trainable else 0)  # final norm
        per_token += r * h  # the positions with a target, gathered for the loss
    per_token += 2 * 4 * shapes.head_dim + _BATCH_BYTES_PER_TOKEN
    copies = [
        dora_weight_copies(layer, regime)
        + qat_weight_bytes(layer, regime, census.qat)
        + expert_lora_weights(layer, regime)
        + oft_rotations(layer, regime, partial(_input_needs_grad, grad_in=grad_in))
        for layer, flow, grad_in in zip(census.layers, flows, into)
        if flow
    ]
    block = tokens * max(blocks, default=0) + max(copies, default=0)
    kept = tokens * per_token + (0 if checkpointing else sum(copies))
    host = 0
    if offload and checkpointing and blocks:
        one_input = tokens * r * h
        host = len(blocks) * _pinned_bytes(one_input)
        kept -= tokens * len(blocks) * r * h
        block += one_input  # the recomputed block's input, back on the device
    return Saved(kept=kept, block=block, checkpointing=checkpointing, host=host)


def experts_transient_bytes(census: Census) -> int:
    """QLoRA's NF4 experts (quantize_experts): one block's weights dequantised while it
    runs, in forward and again in backward's recompute. 0 without them."""
    return max(
        (
            layer.experts.weight_numel * layer.experts.nf4_itemsize
            for layer in census.layers
            if layer.experts is not None
        ),
        default=0,
    )


def _input_needs_grad(linear: LinearInfo, *, grad_in: bool) -> bool:
    """Whether a linear's input needs a gradient: every one's does when the block's input
    does; otherwise the readers of the block's input (the attention projections) do not."""
    return grad_in or _INPUT_GROUP.get(linear.name) != "attn_in"


def _oft_reads(layer: LayerInfo, group: str) -> bool:
    """Whether OFT wraps a linear of `layer` that reads `group`'s input."""
    return any(m.oft_block and _INPUT_GROUP.get(m.name) == group for m in layer.linears)


def _pinned_bytes(nbytes: int) -> int:
    """What PyTorch's pinned host allocator takes for `nbytes` (the next power of two)."""
    return 1 << max(0, nbytes - 1).bit_length()


def loss_bytes(
    census: Census,
    shapes: Shapes,
    regime: Regime,
    *,
    tokens: int,
    chunk: int,
    head_grad_itemsize: int,
) -> int:
    """The peak of the loss's backward (keel.losses.causal_lm.chunked_cross_entropy).

    Backward recomputes one chunk of logits at a time; inside log-softmax's backward it
    holds, in fp32, the saved log-softmax output, the gradient arriving from the loss and
    the gradient it passes on: 3 x 4 bytes x chunk x vocab (the forward holds less: the
    logits, their fp32 copy, the log-softmax). Then the output layer's weight gradient of
    that chunk exists beside the chunk's logit gradient (4 bytes x chunk x vocab) until it
    is added to the accumulated one. Around both: the gradients of the gathered hidden
    states and of the decoder output (2 x r x h per token). A model whose head is not a
    plain projection (soft-capping, logit scaling) takes the full forward: one chunk of
    all tokens.
    """
    rows = min(chunk, tokens) if shapes.plain_head else tokens
    head = shapes.vocab * shapes.hidden * head_grad_itemsize if census.head_trainable else 0
    logits = max(12 * rows * shapes.vocab, 4 * rows * shapes.vocab + head)
    return logits + 2 * regime.residual * shapes.hidden * tokens


def autocast_copy_bytes(
    census: Census, shapes: Shapes, regime: Regime, *, checkpointing: bool
) -> int:
    """Weights autocast keeps in the compute dtype (fp32 weights, bf16/fp16 compute).

    Trainable weights (LoRA adapters included) are cast once per forward and cached until
    it ends (whole model); frozen ones are cast per use and saved for backward by every
    block in the gradient's path (one block at a time with checkpointing). The output
    layer's copy exists while the loss runs.
    """
    c = regime.compute
    adapters = (
        0
        if regime.adapters or c == 4
        else sum(
            m.lora_numel
            for layer in census.layers
            for m in layer.linears
            if m.lora_rank and m.lora_itemsize > c
        )
    )
    if not regime.weight_copies:
        return c * adapters
    trainable = frozen_max = frozen_sum = 0
    for layer, flow in zip(census.layers, grad_path(census)):
        weights = [(m.weight_numel, m.trainable) for m in layer.linears]
        trainable += sum(n for n, trains in weights if trains)
        # QLoRA's frozen linears are already NF4 or in the compute dtype: no copies
        held = flow and census.method != "qlora"
        frozen = sum(n for n, trains in weights if not trains) if held else 0
        frozen_max, frozen_sum = max(frozen_max, frozen), frozen_sum + frozen
    frozen_kept = frozen_max if checkpointing else frozen_sum
    return c * (trainable + frozen_kept + adapters + shapes.vocab * shapes.hidden)
