"""The policy, made ready to generate its own rollouts in the middle of training.

Generation runs through the Hugging Face (or PEFT) model inside the objective, never through
a DDP wrapper, and under FSDP2 with every unit gathered once beforehand: generation itself
then makes no collective, so ranks may decode different numbers of tokens without waiting
for each other (the hang of trl#7103 / unsloth#4559: per-token all-gathers out of step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn

from keel.distributed.parallelize import is_sharded, unwrap, whole_units
from keel.distributed.process_group import DistContext
from keel.distributed.watchdog import Progress
from keel.models.attention import VARLEN_ATTENTION
from keel.train.objective import causal_lm_of, text_model, use_attention

# What keel's varlen attention gives way to while generating: it takes samples laid end to
# end without a KV cache or mask; sdpa takes both (and is what it was checked against).
GENERATION_ATTENTION = "sdpa"


@contextmanager
def generation_ready(
    objective: nn.Module, *, dist: DistContext, progress: Progress, gather_limit: float | None
) -> Iterator[nn.Module]:
    """Yield the objective's policy model (HF or PEFT) ready to generate: in eval mode,
    with keel's varlen attention switched to sdpa, and under FSDP2 with every unit gathered
    once, in module order (the same collectives on every rank), inside the watchdog phase
    "weight gather" (`gather_limit`: seconds without progress before it is a hang; None:
    unwatched). Everything is restored on exit: the units resharded, train mode and the
    attention put back. Every rank must enter together when the model is sharded.
    """
    inner = unwrap(objective)
    policy = inner.model
    with ExitStack() as stack:
        if is_sharded(inner):
            with progress.phase("weight gather", gather_limit):
                # keel's checked collective first: a rank that never comes to the gather
                # is reported as a hang (with every rank's stack), not left in gloo.
                dist.barrier()
                stack.enter_context(whole_units(inner, mark=progress.mark))
        stack.enter_context(_evaluating(policy))
        stack.enter_context(_attention_for_generation(policy))
        yield policy


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout), each module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextmanager
def _attention_for_generation(model: nn.Module) -> Iterator[None]:
    """sdpa instead of keel's varlen attention while generating; the training attention
    restored after. Any other attention (sdpa, eager, flash) generates as it is."""
    implementation = text_model(causal_lm_of(model)).config._attn_implementation
    if implementation != VARLEN_ATTENTION:
        yield
        return
    use_attention(model, GENERATION_ATTENTION)
    try:
        yield
    finally:
        use_attention(model, implementation)
