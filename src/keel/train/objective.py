"""How a batch becomes a loss. Stages differ only here; the loop is shared.

`CausalLMObjective` is an nn.Module so that a data-parallel wrapper can wrap it whole: the
forward it runs (decoder -> selected hidden states -> chunked output layer + CE) is the one
that gets synchronised, not the Hugging Face forward we bypass.

That bypass ("fast head") is only valid when the model's logits are exactly
output_embeddings(decoder(...).last_hidden_state). Some families post-process logits in
their *ForCausalLM forward (Granite divides by `logits_scaling`, Gemma 2 soft-caps, Cohere
multiplies by `logit_scale`), and new ones may do anything. So instead of a list of config
names, `check_fast_head` compares the fast head with the model's own forward, once, at
set-up; the objective uses the fast head only when they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from keel.distributed.context_parallel import CP_GROUP, shard_tokens
from keel.losses import (
    IGNORE_INDEX,
    TokenWeighting,
    chunked_cross_entropy,
    chunked_weighted_cross_entropy,
    cross_entropy_sum,
    weighted_cross_entropy_sums,
)
from keel.models.attention import (
    PREFIX_GROUPS,
    SEQ_LENS,
    VARLEN_ATTENTION,
    embed_whole_row,
    register_varlen_attention,
)
from keel.models.vision import VisionFamily, family_of
from keel.models.vision.family import module_or_parameter
from keel.stages.base import ObjectiveOutput
from keel.train.router_balance import RouterBalance

# Logit magnitude of the probe's synthetic hidden states. A random or freshly initialised
# model has |logit| ~ 0.1, where cap * tanh(x / cap) equals x to ~1e-7; trained models
# reach tens, so the probe looks there.
PROBE_LOGIT_MAGNITUDE = 50.0
PROBE_TOKENS = 8
# Largest |fast - forward| / max|forward logit| accepted, by the dtype the decoder computes
# in: fp32 round-off, or about two units in the last place at the probe magnitude for bf16
# (2^-7 relative) and fp16 (2^-10). Both sides run the same matmul, so agreeing models
# usually differ by exactly 0; a post-processed head differs by tens of percent.
PROBE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Sample lengths of the padding-free attention probe: two samples laid end to end, the
# second longer than the first so that a leak across samples changes its logits.
PROBE_SAMPLES = (5, 7)


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The Hugging Face *ForCausalLM module inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_of(lm: nn.Module, vision: VisionFamily | None) -> nn.Module:
    """The module whose last_hidden_state the output layer turns into `lm`'s logits: the
    decoder, or for a vision-language model its base model (`lm.model`), which merges the
    image features into the token embeddings first (`get_decoder()` would skip them)."""
    return lm.model if vision is not None else lm.get_decoder()


def vision_modules(lm: nn.Module, vision: VisionFamily | None) -> list[nn.Module | nn.Parameter]:
    """The vision tower and projector of `lm` (the model under any PEFT wrapper), by its
    family's paths: modules, and bare parameters such as LLaVA-NeXT's image_newline; [] for
    a text model. Data parallelism keeps them whole on every rank
    (keel.distributed.parallelize: ParallelizeSettings.replicated)."""
    if vision is None:
        return []
    return [module_or_parameter(lm, path) for path in (*vision.tower, *vision.projector)]


def model_inputs(
    batch: dict, prefix: str = "", *, vision: VisionFamily | None = None, config=None
) -> dict:
    """The keyword arguments of a training forward for `batch`'s `prefix`ed sequences.

    No attention mask and no cache: right padding is invisible to real tokens under causal
    attention, packed samples are separated by their restarting position ids, and a
    padding-free micro-batch (one concatenated row) carries its sample lengths (and, for
    rollout rows sharing prompts, its prefix groups) for keel's varlen attention. A
    vision-language model (`vision`, its family, and `config`, the model's) also gets its
    images' and tokens' inputs (`vision_inputs`).
    """
    inputs = dict(
        input_ids=batch[f"{prefix}input_ids"],
        position_ids=batch.get(f"{prefix}position_ids"),
        use_cache=False,
    )
    seq_lens = batch.get(f"{prefix}seq_lens")
    if seq_lens is not None:
        inputs[SEQ_LENS] = seq_lens
    if batch.get("cp_group") is not None:  # context parallelism: a part of the row's tokens
        inputs[CP_GROUP] = batch["cp_group"]
    groups = batch.get(f"{prefix}prefix_groups")  # rollout rows sharing their prompts
    if groups is not None:
        inputs[PREFIX_GROUPS] = groups
    if vision is not None:
        inputs |= vision_inputs(batch, prefix, inputs["position_ids"], vision, config)
    return inputs


def vision_inputs(
    batch: dict, prefix: str, position_ids: torch.Tensor | None, vision: VisionFamily, config
) -> dict:
    """The family's forward arguments for a micro-batch: its images' tensors (in token
    order, already on the device), per-token inputs from the ids, and for 3-D rotary
    families the positions: [3, B, T] (t, h, w) per sample, under a row of the text
    positions ([4, B, T]) when there are any, from which transformers tells packed samples
    apart."""
    extra = vision.token_inputs(batch[f"{prefix}input_ids"], config)
    # KTO's KL sequences (prefix kl_) start with their samples' prompts, in the same rows and
    # order: the batch's images are theirs too
    images = batch.get("images")
    if images:
        extra |= vision.model_inputs(images)
    rope = batch.get(f"{prefix}rope_position_ids")  # [3, B, T]
    if rope is not None:
        text = position_ids  # [B, T] or None (right-padded rows, one sample each)
        extra["position_ids"] = rope if text is None else torch.cat([text[None], rope])
    return extra


def use_attention(model: nn.Module, implementation: str) -> None:
    """Switch the causal LM inside `model` (PEFT or not) to an attention implementation;
    for a vision-language model its language model only (the vision tower's attention is
    not causal). A vision-language model on keel's varlen attention can also run context
    parallel, which cuts its embedded rows (`embed_whole_row`)."""
    lm = causal_lm_of(model)
    text_model(lm).set_attn_implementation(implementation)
    if implementation == VARLEN_ATTENTION and family_of(lm.config) is not None:
        embed_whole_row(text_model(lm))


def text_model(lm: nn.Module) -> nn.Module:
    """The module whose attention is causal text attention: `lm`, or a vision-language
    model's language model (by its family's path)."""
    vision = family_of(lm.config)
    return lm if vision is None else lm.get_submodule(vision.language_model)


@dataclass(frozen=True)
class LossTerms:
    """What pt and sft training change in the plain summed cross-entropy; each is logged
    as a training metric beside the loss."""

    # train.token_weighting: each token's cross-entropy weighted (logged: ce_loss, the
    # unweighted one, for comparison with eval_loss)
    token_weighting: TokenWeighting | None = None
    # train.router_aux_loss_coef: a mixture of experts' load-balancing term (logged: aux_loss)
    router_balance: RouterBalance | None = None

    def metric_names(self) -> tuple[str, ...]:
        """In the order forward stacks their (sum, count) pairs."""
        return ("ce_loss",) * (self.token_weighting is not None) + ("aux_loss",) * (
            self.router_balance is not None
        )


class CausalLMObjective(nn.Module):
    """Next-token cross-entropy summed over target tokens (pt and sft).

    forward(batch) -> ObjectiveOutput(loss sum, target tokens). With `fast_head`, logits are only computed
    at positions that have a target (prompt and padding positions are skipped) and in
    chunks, so the [B, T, V] logits tensor never exists. Without it, the loss comes from
    the full Hugging Face forward. `fast_head` is off until the caller has run
    `check_fast_head` and it passed: a wrong fast head trains on a different loss than
    the one the model is evaluated and served with.
    """

    metric_names: tuple[str, ...] = ()  # no statistics beside the loss
    needs_window_statistic = False
    reports_perplexity = True  # its eval loss is a mean over tokens
    # rows of preference pairs whose padding-free micro-batches lay each pair's prompt out
    # once for both its sequences (keel.data.collate's share_pairs)
    shares_pair_prompts = False

    def __init__(
        self,
        model: nn.Module,
        *,
        chunk_size: int = 1024,
        fast_head: bool = False,
        vision: VisionFamily | None = None,
        terms: LossTerms | None = None,
    ):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.fast_head = fast_head
        self.vision = vision  # the family of a vision-language model, None for text
        # what training adds to the plain cross-entropy (eval_loss stays the cross-entropy)
        self.terms = terms or LossTerms()
        self.metric_names = self.terms.metric_names()

    def inputs(self, batch: dict, prefix: str = "") -> dict:
        """`model_inputs` of this objective's model (with its family's, for a VLM)."""
        config = causal_lm_of(self.model).config
        return model_inputs(batch, prefix, vision=self.vision, config=config)

    def set_window_statistic(self, value: float) -> None:
        raise AssertionError("next-token cross-entropy needs no window statistic")

    def init_new_weights(self, *, region_of, local) -> None:
        """Initialise the parameters this objective adds beside the model's (none here; the
        reward model's score head), after set-up has allocated them: this process's part,
        `region_of(param)` of the full value (None: all), written into `local(param)`."""

    def forward(
        self, batch: dict[str, torch.Tensor], *, probe: str | None = None
    ) -> ObjectiveOutput | dict:
        """ObjectiveOutput(loss sum, target tokens); with `probe` ("head" or "attention"), what
        `check_fast_head` or `check_varlen_attention` compares.

        Probes go through this forward so that, when the objective is the FSDP root unit,
        FSDP's root hooks gather the output layer and final norm for them.
        """
        if probe == "head":
            return self._probe_logits(self.inputs(batch))
        if probe == "attention":
            return self._probe_attention(batch)
        if probe == "context":
            return self._probe_context(batch)
        inputs = self.inputs(batch)
        targets = batch["targets"]  # [B, T], pre-shifted
        mask = targets != IGNORE_INDEX  # [B, T]
        num_targets = mask.sum()
        balance = self.terms.router_balance if self.training else None
        weighting = self.terms.token_weighting if self.training else None
        if balance is not None:
            inputs["output_router_logits"] = True
        if not self.fast_head:
            out = self.model(**inputs)
            logits = out.logits  # [B, T, V]
            if weighting is None:
                loss = cross_entropy_sum(logits, targets)
            else:
                loss = weighted_cross_entropy_sums(logits, targets, weighting)
        else:
            lm = causal_lm_of(self.model)
            out = decoder_of(lm, self.vision)(**inputs)
            selected = out.last_hidden_state[mask]  # [N, H]
            head, chunk = lm.get_output_embeddings(), self.chunk_size
            if weighting is None:
                loss = chunked_cross_entropy(selected, targets[mask], head, chunk_size=chunk)
            else:
                loss = chunked_weighted_cross_entropy(
                    selected, targets[mask], head, weighting, chunk_size=chunk
                )
        if CP_GROUP in inputs:  # a part without targets still runs the group's backward
            loss = loss + zero_through_model(out, None if not self.fast_head else head)
        if balance is None and weighting is None:
            return ObjectiveOutput(loss, num_targets, self._no_statistics(loss))
        counted = (num_targets > 0).float()  # a filler micro-batch reports nothing
        statistics = []
        if weighting is not None:  # [2]: (weighted sum, plain sum)
            statistics += [loss[1].float(), num_targets.float()]
            loss = loss[0]
        if balance is not None:
            aux = balance.loss(out.router_logits, batch)
            statistics += [aux.detach().float() * counted, counted]
            loss = loss + balance.coefficient * aux * num_targets
        return ObjectiveOutput(loss, num_targets, torch.stack(statistics))

    def _no_statistics(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Zero (sum, count) pairs where the run logs training-only metrics (ce_loss,
        aux_loss) but this forward (eval) has none to add; None otherwise."""
        if not self.metric_names:
            return None
        return loss.new_zeros(2 * len(self.metric_names), dtype=torch.float32)

    def check_fast_head(self, device: torch.device | None = None) -> tuple[bool, str]:
        """(ok, why): does the fast head give the model's own logits? Does not set fast_head.

        Two checks on PROBE_TOKENS random tokens, in eval mode, without autocast or grad:
        (a) the model's forward vs output_embeddings(decoder(...).last_hidden_state) on
        real weights (catches a forward that does more than call the decoder); (b) the
        model's forward with the decoder's last_hidden_state replaced by a synthetic one
        scaled to logits of magnitude PROBE_LOGIT_MAGNITUDE vs output_embeddings of it
        (catches scaling, soft-capping or any post-processing, at magnitudes a trained
        model reaches). Tolerance: PROBE_RTOL of the decoder's compute dtype. Under FSDP
        every rank must call it together.
        """
        if device is None:
            device = next(self.parameters()).device
        vocab = _probe_vocab(causal_lm_of(self.model), self.vision)
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(vocab, (1, PROBE_TOKENS), generator=generator)  # [1, T]
        positions = torch.arange(PROBE_TOKENS, device=device)[None]  # [1, T]
        batch = {"input_ids": input_ids.to(device), "position_ids": positions}
        return _judge(self._run_probe(batch, "head"), "head")

    def check_varlen_attention(self, device: torch.device | None = None) -> tuple[bool, str]:
        """(ok, why): does keel's varlen attention (keel.models.attention) give the model's
        own logits for samples laid end to end? Does not switch the model.

        Two random samples (PROBE_SAMPLES tokens) run one at a time through the model's
        own attention and once concatenated through VARLEN_ATTENTION, in eval mode without
        autocast or grad; each sample's logits must agree to PROBE_RTOL of the compute
        dtype. Only models on transformers' sdpa are candidates (flash_attention_2 handles
        padding-free rows itself; eager is left as it is). Under FSDP every rank must call
        it together.
        """
        implementation = text_model(causal_lm_of(self.model)).config._attn_implementation
        if implementation != "sdpa":
            return False, f"the model's attention is {implementation}, not sdpa"
        if self.vision is not None and self.vision.image_attention != "causal":
            return False, (
                f"{self.vision.name}'s image tokens attend to each other both ways "
                "(keel's varlen attention is causal only)"
            )
        if device is None:
            device = next(self.parameters()).device
        batch = self._probe_row(PROBE_SAMPLES, seed=2, device=device)
        return _judge(self._run_probe(batch, "attention"), "attention")

    def check_context_parallel(self, group, rank: int, size: int) -> tuple[bool, str]:
        """(ok, why): does this process's part of a row, run context parallel over `group`
        (keel.distributed.context_parallel), give the logits of the whole row there? The
        model must already run keel's varlen attention; a layer that mixes tokens outside
        attention (a state-space layer) fails. Every process of the group must call it."""
        # two samples, the first running into the second process's part
        lengths = (size * PROBE_SAMPLES[0] + 1, PROBE_SAMPLES[1])
        whole = self._probe_row(lengths, seed=3, device=next(self.parameters()).device)
        whole["seq_lens"] = lengths
        part = shard_tokens(
            whole | {"targets": whole["input_ids"]},
            rank,
            size,
            pad_id=0,
            whole_inputs=self.vision is not None,
        )
        span = part["targets"].shape[1]
        real = (rank * span, min(span, sum(lengths) - rank * span))  # (start, real tokens)
        batch = {"whole": whole, "part": part | {"cp_group": group}, "real": real}
        batch["input_ids"] = whole["input_ids"]  # where _run_probe reads the device
        return _judge(self._run_probe(batch, "context"), "context")

    def _probe_context(self, batch: dict) -> dict:
        """{"dtype", "checks": {...: (the whole row's logits, the part's)}} over the part's
        real tokens (`check_context_parallel`)."""
        (start, real), logits = batch["real"], {}
        for name in ("whole", "part"):
            logits[name] = self.model(**self.inputs(batch[name])).logits  # [1, T or T/C, V]
        want = logits["whole"][:, start : start + real]
        checks = {f"tokens {start}-{start + real - 1}": (want, logits["part"][:, :real])}
        return {"dtype": want.dtype, "checks": checks}

    def _probe_row(self, lengths: tuple[int, ...], *, seed: int, device) -> dict:
        """One row of random samples of `lengths` laid end to end: input_ids and
        position_ids [1, T] (restarting with each sample) on `device`."""
        vocab = _probe_vocab(causal_lm_of(self.model), self.vision)
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(vocab, (1, sum(lengths)), generator=generator)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, T]
        return {"input_ids": input_ids.to(device), "position_ids": positions.to(device)}

    def _run_probe(self, batch: dict, probe: str) -> dict:
        modes = [(m, m.training) for m in self.modules()]
        self.eval()  # no dropout, no gradient checkpointing, no router noise
        try:
            with torch.no_grad(), torch.autocast(batch["input_ids"].device.type, enabled=False):
                return self(batch, probe=probe)
        finally:
            for module, training in modes:
                module.training = training

    def _probe_attention(self, batch: dict) -> dict:
        """{"dtype", "checks": {sample: (own attention logits, varlen logits)}} or
        {"error": why}."""
        own = text_model(causal_lm_of(self.model)).config._attn_implementation
        alone = []
        start = 0
        for n in PROBE_SAMPLES:
            ids = batch["input_ids"][:, start : start + n]  # [1, n]
            alone.append(self.model(input_ids=ids, use_cache=False).logits)  # [1, n, V]
            start += n
        register_varlen_attention()
        use_attention(self.model, VARLEN_ATTENTION)
        try:
            inputs = self.inputs(batch | {"seq_lens": PROBE_SAMPLES})
            together = self.model(**inputs).logits  # [1, T, V]
        except (ValueError, TypeError, RuntimeError) as error:
            return {"error": f"keel's varlen attention does not run on this model: {error}"}
        finally:
            use_attention(self.model, own)
        pieces = together.split(PROBE_SAMPLES, dim=1)
        checks = {f"sample {i + 1}": (a, b) for i, (a, b) in enumerate(zip(alone, pieces))}
        return {"dtype": together.dtype, "checks": checks}

    def _probe_logits(self, inputs: dict) -> dict:
        """{"dtype": compute dtype, "checks": {name: (forward logits, fast-head logits)}}, or
        {"error": why} when the model has no decoder/output layer the fast head can use."""
        lm = causal_lm_of(self.model)
        decoder, head = decoder_of(lm, self.vision), lm.get_output_embeddings()
        if not isinstance(head, nn.Module):
            return {"error": f"{type(lm).__name__} has no output embeddings module"}
        logits = self.model(**inputs).logits  # [1, T, V]
        hidden = getattr(decoder(**inputs), "last_hidden_state", None)  # [1, T, H]
        if hidden is None:
            return {
                "error": f"{type(decoder).__name__} (get_decoder()) returns no last_hidden_state"
            }
        noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
        noise = noise.to(hidden)  # [1, T, H]
        magnitude = head(noise).float().abs().amax(-1, keepdim=True)  # [1, T, 1]
        synthetic = noise * (PROBE_LOGIT_MAGNITUDE / magnitude.clamp_min(1e-12)).to(noise)

        def replace_hidden(_module, _args, output):
            if isinstance(output, tuple):
                return (synthetic, *output[1:])
            output.last_hidden_state = synthetic  # ModelOutput: also sets output[0]
            return output

        handle = decoder.register_forward_hook(replace_hidden)
        try:
            logits_synthetic = self.model(**inputs).logits  # [1, T, V]
        finally:
            handle.remove()
        checks = {
            "real tokens": (logits, head(hidden)),
            f"logits ~{PROBE_LOGIT_MAGNITUDE:g}": (logits_synthetic, head(synthetic)),
        }
        return {"dtype": hidden.dtype, "checks": checks}


def zero_through_model(out, head: nn.Module | None) -> torch.Tensor:
    """Zero that depends on the model's output and output layer (`head`: the fast head's,
    applied here to one position; None: `out` has logits). Under context parallelism every
    process of a group must run the backward exchanges its forward ran, and use every
    weight DDP and FSDP2 wait for, including a process whose part of the row has no target
    tokens (its loss is a constant otherwise)."""
    output = out.logits[:, :1] if head is None else head(out.last_hidden_state[:, :1])
    return 0.0 * output.sum()


def _vocab_size(lm: nn.Module) -> int:
    embeddings = lm.get_input_embeddings()
    return getattr(embeddings, "num_embeddings", None) or embeddings.weight.shape[0]


def _probe_vocab(lm: nn.Module, vision: VisionFamily | None) -> int:
    """How many ids the probes draw from: the vocabulary, or for a vision-language model
    the text ids below its first image/vision special (an image token without its image
    is an error in the model's forward). Every supported family appends those specials
    after the text vocabulary."""
    vocab = _vocab_size(lm)
    if vision is None:
        return vocab
    specials = [
        value
        for key, value in lm.config.to_dict().items()
        if key.endswith(("token_id", "token_index"))
        and not key.startswith(("bos", "eos", "pad"))
        and isinstance(value, int)
    ]
    return min([vocab, *specials])


_MISMATCH = {
    "head": "the model's forward is not output_embeddings(decoder hidden state) at {where}: "
    "it post-processes its logits or runs more than the decoder",
    "attention": "keel's varlen attention differs from the model's own attention at {where}: "
    "it does more than causal attention within each sample",
    "context": "a row's part computed context parallel differs from the whole row at {where}: "
    "a layer mixes tokens outside attention",
}


def _judge(found: dict, probe: str) -> tuple[bool, str]:
    """(ok, why) from what `_probe_logits` or `_probe_attention` found."""
    if "error" in found:
        return False, found["error"]
    dtype = found["dtype"]
    rtol = PROBE_RTOL.get(dtype, PROBE_RTOL[torch.bfloat16])
    seen, failed = [], []
    for name, (want, got) in found["checks"].items():
        want, got = want.float(), got.float()  # [1, T, V]
        diff = (want - got).abs().amax().item()
        rel = diff / max(want.abs().amax().item(), 1e-30)
        seen.append(f"{name}: max abs diff {diff:.3g}, rel {rel:.3g}")
        if not rel <= rtol:  # also catches NaN
            failed.append(name)
    report = f"{'; '.join(seen)}; tolerance rel {rtol:g} ({str(dtype).removeprefix('torch.')})"
    if failed:
        return False, f"{_MISMATCH[probe].format(where=' and '.join(failed))}; {report}"
    return True, report
