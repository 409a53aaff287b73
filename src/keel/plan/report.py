"""A plan as people read it (table, recommendation, refusal) and as programs do (JSON)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from keel.distributed.strategy import STRATEGIES, Strategy
from keel.plan.devices import GIB, USABLE_FRACTION, gib
from keel.plan.estimate import COMPONENTS, Option, shard_degree
from keel.plan.planner import Plan, changes, knob_changes, more_devices, recommend
from keel.plan.vision import LANGUAGE, PROJECTOR, TOWER, image_assumption


def to_json(plan: Plan) -> dict:
    """The `keel plan --json` document."""
    model = {"params": plan.params, "trainable_params": plan.trainable_params}
    if plan.whole_params:  # tensor parallelism: the counts above are one device's part
        model["whole_params"] = plan.whole_params
    if plan.work.vision is not None:
        model["vision"] = _vision_json(plan)
    return {
        "model": model,
        "devices": {
            "count": plan.devices.world,
            "memory_bytes": plan.devices.memory_bytes,
            "kind": plan.devices.kind,
            "tensor_parallel": plan.devices.tensor_parallel,
        },
        "options": [_option_json(o) for o in plan.options],
        "recommendation": _option_json(plan.recommendation) if plan.recommendation else None,
    }


def _vision_json(plan: Plan) -> dict:
    """A vision-language model's parts and image assumption, for `--json`."""
    census, shapes = plan.censuses[plan.method], plan.work.vision
    parts = {
        name: {
            "params": census.part_params(part),
            "trainable_params": census.part_params(part, trainable_only=True),
        }
        for name, part in (("tower", TOWER), ("projector", PROJECTOR), ("language_model", LANGUAGE))
    }
    return {
        **parts,
        "replicated": True,  # tower and projector: whole on every rank
        "images_per_sequence": plan.work.images_per_sequence,
        "tokens_per_image": shapes.tokens_per_image,
        "patches_per_image": shapes.patches_per_image,
    }


def _option_json(option: Option) -> dict:
    return {
        "strategy": option.strategy.value,
        "method": option.method,
        "gradient_checkpointing": option.gradient_checkpointing,
        "per_device_bytes": option.per_device.as_dict(),
        "host_bytes": option.host_bytes,
        "fits": option.fits,
    }


def describe(option: Option) -> str:
    """`fsdp + lora + checkpointing` (`+ offloaded checkpointing` with offload)."""
    ckpt = option.gradient_checkpointing
    return " + ".join(
        [
            option.strategy,
            option.method,
            *(
                ["offloaded checkpointing" if ckpt == "offload" else "checkpointing"]
                if ckpt
                else []
            ),
        ]
    )


def checkpointing_word(value: bool | str) -> str:
    """off | on | offload."""
    return "offload" if value == "offload" else "on" if value else "off"


def table(plan: Plan) -> str:
    """One line per option, sizes in GiB per device (a generation column for a stage that
    generates)."""
    shown = [c for c in COMPONENTS if c != "generation" or plan.work.generation is not None]
    header = ["strategy", "method", "ckpt", *shown, "total", "host", "fits"]
    rows = [header]
    for o in plan.options:
        sizes = [f"{getattr(o.per_device, c) / GIB:.2f}" for c in (*shown, "total")]
        rows.append(
            [
                o.strategy,
                o.method,
                checkpointing_word(o.gradient_checkpointing),
                *sizes,
                f"{o.host_bytes / GIB:.2f}",
                "yes" if o.fits else "no",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if i >= 3 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    return "\n".join(lines)


def summary(plan: Plan) -> str:
    """What the plan is for and what it assumes, above the table."""
    c = plan.censuses[plan.method]
    w = plan.work
    nf4 = sum(t.nf4 for t in c.tensors)
    quant = f", {nf4} frozen linear weights in NF4" if nf4 else ""
    return (
        f"model: {c.params:,} parameters ({c.trainable_params:,} trainable with "
        f"{plan.method}{quant}); devices: {plan.devices.describe()}\n"
        f"per device: micro-batch {w.micro_batch_size} x cutoff_len {w.cutoff_len} "
        f"tokens, precision {w.precision.name}, loss chunk {w.loss_chunk_size}"
        f"{', packing' if w.packing else ''}; sizes in GiB per device (host: RAM per "
        f"process)"
    ) + "".join(f"\n{line}" for line in _extra_summary(plan))


def _extra_summary(plan: Plan) -> list[str]:
    """Tensor parallelism's line, the vision-language model's lines, and what a generating
    stage's step does."""
    w, lines = plan.work, []
    if (tp := plan.devices.tensor_parallel) > 1:
        lines.append(
            f"tensor parallelism: groups of {tp} devices, each holding 1/{tp} of every decoder "
            f"layer's projections, heads and MLP columns; the parameters above are one "
            f"device's (of the model's {plan.whole_params:,}), sharded over "
            f"{plan.devices.dp_size} group(s) by fsdp"
        )
    if w.vision is not None:
        lines.append(_vision_summary(plan))
    experts = [layer.experts for layer in plan.censuses[plan.method].layers if layer.experts]
    if experts:
        routed = sum(e.weight_numel for e in experts)
        qlora = plan.censuses.get("qlora")
        nf4 = qlora is not None and any(
            layer.experts.nf4_itemsize for layer in qlora.layers if layer.experts
        )
        how = (
            "in NF4 (method.qlora.quantize_experts)"
            if nf4
            else "in model.dtype (method.qlora.quantize_experts: NF4)"
        )
        lines.append(
            f"mixture of experts: {len(experts)} layers of {experts[0].count} experts "
            f"({plan.shapes.experts_per_token} per token), {routed:,} parameters "
            f"({100 * routed / plan.params:.0f}%) in the routed experts: full and freeze "
            f"train them; LoRA leaves them frozen, and qlora {how}"
        )
    if w.generation is not None:
        g = w.generation
        reference = (
            "; full and freeze options hold a frozen reference copy (in params: beta > 0)"
            if w.reference_copy
            else ""
        )
        lines.append(
            f"{g.section}: each step first generates, {g.batch_prompts} prompt(s) x "
            f"{g.num_generations} completions at once (generation KV cache, logits and, under "
            f"fsdp, the unsharded replica: the generation column), then trains "
            f"{w.micro_batch_size} prompt(s) x {g.num_generations} completions of up to "
            f"{w.cutoff_len} + {g.max_completion_length} tokens per micro-batch{reference}"
        )
    return lines


def _vision_summary(plan: Plan) -> str:
    """Two lines: the vision-language model's parts, and what its images are taken to be."""
    c = plan.censuses[plan.method]

    def part(name: str, key: str) -> str:
        trainable = c.part_params(key, trainable_only=True)
        return f"{name} {c.part_params(key):,} ({trainable:,} trainable)"

    w = plan.work
    return (
        f"vision-language model: {part('vision tower', TOWER)}, "
        f"{part('projector', PROJECTOR)}, {part('language model', LANGUAGE)}; the tower and "
        f"projector are replicated whole on every rank (never sharded)\n"
        f"{image_assumption(w.vision, w.images_per_sequence, w.cutoff_len)}"
    )


def advice(plan: Plan) -> list[str]:
    """The recommendation, or else what would fit, with the numbers."""
    rec = plan.recommendation
    usable = plan.devices.usable_bytes
    if rec is None:
        head = (
            f"nothing fits: every option needs more than {gib(usable)} GiB per device "
            f"({USABLE_FRACTION:.0%} of {gib(plan.devices.memory_bytes)} GiB). What would:"
        )
        return [head, *_what_would(plan, plan.options)]
    how = " ".join(changes(plan, rec)) or "the config as it is"
    lines = [
        f"recommendation: {describe(rec)}: {gib(rec.per_device.total)} GiB per device of "
        f"{gib(usable)} GiB usable ({how}){_host(plan, rec)}",
        *_generation_lines(rec),
    ]
    if rec.strategy is Strategy.FSDP_OFFLOAD:
        # Offload trades device memory for host RAM the plan cannot see: say what else works.
        kept = [o for o in plan.options if o.strategy is not Strategy.FSDP_OFFLOAD]
        other = recommend(kept, plan.method)
        if other is not None:
            lines.append(
                f"without CPU offload: {describe(other)}: "
                f"{gib(other.per_device.total)} GiB per device "
                f"({' '.join(changes(plan, other))})"
            )
        else:
            lines.append("without CPU offload nothing fits here. What would:")
            lines += _what_would(plan, [o for o in kept if o.method == plan.method])
    if rec.method != plan.method:
        lines.append(f"method {plan.method} fits in no option here. What would make it fit:")
        lines += _what_would(plan, [o for o in plan.options if o.method == plan.method])
    return lines


def _what_would(plan: Plan, options: list[Option]) -> list[str]:
    """From the smallest of `options`: the workload and device changes, with numbers."""
    smallest = min(options, key=lambda o: o.per_device.total)
    lines = [
        f"  from the smallest option, {describe(smallest)} ({gib(smallest.per_device.total)} GiB):",
        *_generation_lines(smallest, indent="  "),
    ]
    knobs = knob_changes(plan, smallest)
    if smallest.strategy is Strategy.FSDP_OFFLOAD:
        knobs.append(more_devices(plan, smallest.method, smallest.gradient_checkpointing))
    for change, option in knobs:
        verdict = "fits" if option.fits else "still does not fit"
        lines.append(f"  - {change}: {gib(option.per_device.total)} GiB per device, {verdict}")
    return lines


def _generation_lines(option: Option, indent: str = "") -> list[str]:
    """What `option` holds while it generates (a generating stage), one term a line."""
    if option.generation is None:
        return []
    return [f"{indent}  while generating: {line}" for line in option.generation.lines()]


def _host(plan: Plan, option: Option) -> str:
    if plan.devices.kind != "cuda":
        return ""
    node = option.host_bytes * plan.devices.per_node
    return f"; host RAM {gib(option.host_bytes)} GiB per process, {gib(node)} GiB per node"


@dataclass(frozen=True)
class Decision:
    """What `keel train` does: train with `option` or refuse with `message`."""

    strategy: Strategy
    option: Option
    fits: bool
    message: str


def decide(plan: Plan) -> Decision:
    """The strategy a run uses with its configured method and checkpointing.

    distributed.strategy auto: the cheapest strategy that fits. An explicit strategy: that
    one. Either way, when it does not fit, `fits` is False and `message` says what would.
    """
    ours = [plan.option_for(s, plan.method, plan.checkpointing) for s in STRATEGIES]
    ours = [o for o in ours if o is not None]
    if plan.strategy is not None:
        chosen = next(o for o in ours if o.strategy == plan.strategy)
    else:
        chosen = next((o for o in ours if o.fits), ours[-1])
    size = f"{gib(chosen.per_device.total)} GiB per device of {gib(plan.devices.usable_bytes)}"
    if chosen.fits:
        if chosen.strategy is Strategy.SINGLE:
            how = "one process"
        elif plan.devices.tensor_parallel > 1:
            how = "tensor parallelism runs under fsdp"
        elif plan.strategy:
            how = "set by distributed.strategy"
        else:
            how = "auto: the cheapest that fits"
        shards = shard_degree(plan.devices, plan.work)
        if chosen.strategy.shards and shards < plan.devices.dp_size:
            copies = plan.devices.dp_size // shards
            how += f"; HSDP: {copies} copies, each sharded over {shards} processes"
        if plan.work.context_parallel > 1:
            how += f"; each micro-batch's tokens split over {plan.work.context_parallel} processes"
        if plan.devices.tensor_parallel > 1:
            how += f"; each decoder layer split over {plan.devices.tensor_parallel} processes"
        return Decision(
            chosen.strategy,
            chosen,
            True,
            f"plan: {describe(chosen)} needs {size} GiB usable ({how})",
        )
    return Decision(chosen.strategy, chosen, False, refusal(plan, chosen))


def refusal(plan: Plan, option: Option) -> str:
    """Why `option` cannot run here, and the smallest change that fits."""
    which = "configured" if plan.strategy else "most sharded"
    head = (
        f"the {which} strategy {option.strategy} ({option.method}, gradient "
        f"checkpointing {checkpointing_word(option.gradient_checkpointing)}) needs "
        f"{gib(option.per_device.total)} GiB per device of "
        f"{gib(plan.devices.usable_bytes)} GiB usable ({USABLE_FRACTION:.0%} of "
        f"{gib(plan.devices.memory_bytes)} GiB, {plan.devices.world} device(s))"
    )
    if option.generation is not None:
        head += f"; while generating: {', '.join(option.generation.lines())}"
    return (
        f"{head}; the smallest change that fits: {_smallest_fix(plan, option)}. Run `keel "
        f"plan` with this config for every option; set distributed.plan=warn to train anyway."
    )


def _smallest_fix(plan: Plan, option: Option) -> str:
    # One setting at a time, cheapest first (freeze, which trains far less, only through
    # the recommendation); then the recommendation (several settings); then workload and
    # device changes.
    later = STRATEGIES[STRATEGIES.index(option.strategy) + 1 :]
    singles = [
        plan.option_for(option.strategy, option.method, True),
        *(plan.option_for(s, option.method, option.gradient_checkpointing) for s in later),
        plan.option_for(option.strategy, option.method, "offload"),
        plan.option_for(option.strategy, "lora", option.gradient_checkpointing),
    ]
    for candidate in [*singles, plan.recommendation]:
        if candidate is not None and candidate.fits:
            return (
                f"{' '.join(changes(plan, candidate))} "
                f"({gib(candidate.per_device.total)} GiB per device)"
            )
    for change, tried in knob_changes(plan, option):
        if tried.fits:
            return f"{change} ({gib(tried.per_device.total)} GiB per device)"
    return "none found; use more or larger devices"


def lighter(plan: Plan, option: Option, most: int = 4) -> list[str]:
    """Single changes to `option` that need less memory per device, least first, each with
    its estimate: what to try after running out of memory anyway (the estimate was low)."""
    work = plan.work
    candidates = []
    if not option.gradient_checkpointing:
        candidates.append(
            (
                "train.gradient_checkpointing=true",
                plan.estimate(option.strategy, option.method, True),
            )
        )
    if option.gradient_checkpointing != "offload" and plan.devices.kind == "cuda":
        candidates.append(
            (
                "train.gradient_checkpointing=offload",
                plan.estimate(option.strategy, option.method, "offload"),
            )
        )
    for key, name in (
        ("train.micro_batch_size", "micro_batch_size"),
        ("data.cutoff_len", "cutoff_len"),
    ):
        value = getattr(work, name) // 2
        if value >= 1 and (name != "cutoff_len" or value >= 8):
            candidates.append(
                (
                    f"{key}={value}",
                    plan.estimate(
                        option.strategy,
                        option.method,
                        option.gradient_checkpointing,
                        work=replace(work, **{name: value}),
                    ),
                )
            )
    if option.method == "full" and "lora" in plan.censuses:  # not with method.qat
        candidates.append(
            (
                "method.type=lora",
                plan.estimate(option.strategy, "lora", option.gradient_checkpointing),
            )
        )
    if option.method in ("full", "lora") and "qlora" in plan.censuses:
        candidates.append(
            (
                "method.type=qlora (frozen linear weights in NF4)",
                plan.estimate(option.strategy, "qlora", option.gradient_checkpointing),
            )
        )
    now = option.per_device.total
    better = sorted(
        (c for c in candidates if c[1].per_device.total < now), key=lambda c: c[1].per_device.total
    )
    return [
        f"{change} ({gib(tried.per_device.total)} GiB per device, now {gib(now)})"
        for change, tried in better[:most]
    ]
