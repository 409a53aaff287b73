"""What online generation (grpo) adds to a step's memory, per device.

A grpo step first generates its prompts' completions, then trains on them. While it
generates, the device holds the weights and AdamW state (the gradients were freed by the
last optimizer step; DDP's buckets stay) and:
- the generation KV cache: 2 (keys and values) x layers x kv_heads x head_dim x bytes x
  (prompt, at most data.cutoff_len, + grpo.max_completion_length) tokens x the sequences
  generated at once (grpo.generation_batch_prompts x grpo.num_generations). The bytes are
  those of the dtype generation computes in: FSDP2's gathered (mixed-precision) dtype, else
  the weights' own (generation runs outside the training step's autocast, so fp32 master
  weights give an fp32 cache: the larger estimate);
- the generation logits: the last position's [sequences x vocab] row, in fp32;
- under FSDP2, the generation replica: keel.train.rollout_generation unshards every unit
  once before generating (so generation makes no collective), i.e. the whole model in the
  gathered dtype beside this rank's shards.
The training phase then runs micro_batch_size x num_generations rows of up to cutoff_len +
max_completion_length tokens (keel.plan.estimate.Workload). The two phases come one after
the other, so the step's peak is the larger of them, not their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.plan.activations import Shapes
from keel.plan.census import ROOT, Census
from keel.plan.devices import gib

# What the generation logits are sampled from: fp32 (keel.infer.serve.sampling)
_LOGITS_ITEMSIZE = 4


@dataclass(frozen=True, kw_only=True)
class GenerationWork:
    """What a generating stage's section asks for, as the plan needs it."""

    section: str  # the stage's config section, for the changes the plan suggests ("grpo")
    num_generations: int  # completions per prompt: training rows per prompt
    max_completion_length: int
    batch_prompts: int  # prompts generated together (generation_batch_prompts)

    @property
    def sequences(self) -> int:
        """Sequences in the KV cache at once."""
        return self.batch_prompts * self.num_generations


@dataclass(frozen=True, kw_only=True)
class GenerationBytes:
    """Per-device bytes of the generation phase, besides the weights and AdamW state."""

    kv_cache: int
    logits: int
    replica: int  # FSDP2's unsharded weights while generating; 0 without FSDP2
    # how the KV cache was counted, for the plan's text
    layers: int
    kv_width: str  # "4 kv heads x 64 head_dim"
    itemsize: int
    tokens: int
    sequences: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.logits + self.replica

    def lines(self) -> list[str]:
        """One line per term, each with its size in GiB and what it counts."""
        lines = [
            f"generation KV cache {gib(self.kv_cache)} GiB (2 x {self.layers} layers x "
            f"{self.kv_width} x {self.itemsize} bytes x {self.tokens} tokens x "
            f"{self.sequences} sequences)",
            f"generation logits {gib(self.logits)} GiB ({self.sequences} sequences x vocab, fp32)",
        ]
        if self.replica:
            lines.append(
                f"generation replica {gib(self.replica)} GiB (fsdp: every unit unsharded "
                f"while generating)"
            )
        return lines


def kv_cache_bytes(shapes: Shapes, *, tokens: int, sequences: int, itemsize: int) -> int:
    """Keys and values of every layer for `sequences` sequences of `tokens` tokens."""
    per_token = 2 * shapes.layers * shapes.kv_heads * shapes.head_dim * itemsize
    return per_token * tokens * sequences


def replica_bytes(census: Census, itemsize: int, dp_size: int) -> int:
    """Every FSDP2 unit's weights gathered at `itemsize` (NF4 ones at their packed bytes)."""
    units = [*range(census.units), ROOT]
    return sum(census.unit_gathered_bytes(unit, itemsize, dp_size) for unit in units)


def generation_bytes(
    census: Census,
    shapes: Shapes,
    work: GenerationWork,
    *,
    prompt_len: int,
    itemsize: int,
    sharded_over: int | None,
) -> GenerationBytes:
    """The generation phase's bytes with weights computing at `itemsize` bytes per element;
    `sharded_over`: FSDP2's data-parallel degree (None: the weights are whole already)."""
    tokens = prompt_len + work.max_completion_length
    return GenerationBytes(
        kv_cache=kv_cache_bytes(shapes, tokens=tokens, sequences=work.sequences, itemsize=itemsize),
        logits=_LOGITS_ITEMSIZE * work.sequences * shapes.vocab,
        replica=0 if sharded_over is None else replica_bytes(census, itemsize, sharded_over),
        layers=shapes.layers,
        kv_width=f"{shapes.kv_heads} kv heads x {shapes.head_dim} head_dim",
        itemsize=itemsize,
        tokens=tokens,
        sequences=work.sequences,
    )
