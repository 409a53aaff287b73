"""The keel config a translation writes and the fate of each of their keys, shared by both
dialects, and the rules for the keys both take from the Hugging Face Trainer's arguments
(optim, lr_scheduler_type, save_strategy): the same names mean the same in both."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from keel.config.dialects.report import Dialect, KeyFate, Translation
from keel.config.start_adapter import SHAPE


@dataclass(kw_only=True)
class Build:
    """The keel config being written from their config `raw` (read from `source`), and the
    fate of each of their keys so far. `stage` is keel's stage for their config, None where
    keel has none (their stage is refused)."""

    raw: dict
    source: Path
    stage: str | None
    # keel's model.path / model.revision given on the command line: the model that trains,
    # whatever their file names (the family-template check reads this one)
    model_override: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    fates: list[KeyFate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set(self, dotted: str, value) -> None:
        """Set a keel key given dotted (`train.lr`) in the nested config."""
        *sections, name = dotted.split(".")
        node = self.config
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value

    def put(self, key: str, target: str, value, why: str = "") -> None:
        """Their `key` becomes keel's `target` = `value`."""
        self.set(target, value)
        self.mapped(key, target, why)

    def mapped(self, key: str, target: str, why: str = "") -> None:
        """Their `key` is mapped to `target`, written elsewhere (or by another key)."""
        self.fates.append(KeyFate(key, "mapped", target, why))

    def ignored(self, key: str, why: str) -> None:
        self.fates.append(KeyFate(key, "ignored", why=why))

    def refused(self, key: str, why: str) -> None:
        self.fates.append(KeyFate(key, "refused", why=why))

    def mapping(self, key: str, value, *, empty: str, what: str) -> bool:
        """Whether `value` is a non-empty mapping to read entry by entry; else its fate is
        recorded: ignored when empty (`empty` says why), refused when not a mapping (`what`
        says what it should be)."""
        if not value:
            self.ignored(key, empty)
        elif not isinstance(value, dict):
            self.refused(key, f"{value!r}: {what}")
        return bool(value) and isinstance(value, dict)

    def kept(self, target: str, value, why: str) -> None:
        """Write their default for a key they left out, where keel's differs, and say so in
        the report's defaults group (`target = value: why`)."""
        self.set(target, value)
        self.notes.append(f"{target} = {value}: {why}")

    def translation(self, dialect: Dialect) -> Translation:
        if (self.config.get("model") or {}).get("adapter"):
            self._defer_to_adapter()
        return Translation(dialect=dialect, config=self.config, fates=self.fates, notes=self.notes)

    def _defer_to_adapter(self) -> None:
        """With an adapter to keep training (model.adapter), its adapter_config.json decides
        the LoRA shape, as they load it (PEFT's from_pretrained): their shape keys, given or
        defaulted, are ignored and keel reads the adapter's (keel.config.start_adapter)."""
        lora = (self.config.get("method") or {}).get("lora") or {}
        for name in SHAPE:
            lora.pop(name, None)
        why = "the adapter it keeps training decides it (its adapter_config.json, model.adapter)"
        self.fates = [
            KeyFate(f.key, "ignored", why=why) if f.key in _THEIR_SHAPE_KEYS else f
            for f in self.fates
        ]
        shaped = tuple(f"method.lora.{name} =" for name in SHAPE)
        self.notes = [note for note in self.notes if not note.startswith(shaped)]


# their keys for the LoRA shape a saved adapter fixes (keel.config.start_adapter.SHAPE)
_THEIR_SHAPE_KEYS = (
    *("lora_rank", "lora_alpha", "lora_target", "use_rslora", "additional_target"),
    *("lora_r", "lora_target_modules", "lora_target_linear", "peft_use_rslora"),
    *("use_dora", "peft_use_dora"),
    "lora_modules_to_save",
)

# The Trainer's optimizer names keel has: name -> (keel's train.optimizer, a note)
_8BIT = "torchao's block-quantised 8-bit moments, not bitsandbytes'"
_OPTIMIZERS = {
    "adamw_torch": ("adamw", ""),
    "adamw_torch_fused": ("adamw", "keel's AdamW (fp32 moments)"),
    "adamw_hf": ("adamw", ""),
    "adamw_8bit": ("adamw_8bit", _8BIT),
    "adamw_bnb_8bit": ("adamw_8bit", _8BIT),
    "paged_adamw_8bit": ("adamw_8bit", "torchao's 8-bit moments; keel does not page them"),
    "adamw_torch_8bit": ("adamw_8bit", "torchao's block-quantised 8-bit moments"),
    "adamw_torch_4bit": ("adamw_4bit", "torchao's 4-bit moments"),
    "paged_adamw_32bit": ("adamw", "keel does not page optimizer state to the host"),
}
_SCHEDULERS = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}


def optimizer(build: Build, key: str, value) -> None:
    """The Trainer's `optim` name as train.optimizer."""
    if build.raw.get("use_muon"):  # LLaMA-Factory's switch replaces the Trainer's optimizer
        build.ignored(key, "use_muon is on, and replaces it")
    elif value in _OPTIMIZERS:
        choice, why = _OPTIMIZERS[value]
        build.put(key, "train.optimizer", choice, why)
    elif value == "muon":  # Axolotl's
        build.refused(key, AXOLOTL_MUON)
    else:
        why = f"{value!r}: keel's optimizers are AdamW in 32, 8 or 4 bits (adamw_torch, "
        build.refused(key, why + "adamw_8bit, adamw_torch_4bit) and Muon")


# Dion's Muon (axolotl-contribs-mit) with adjust_lr "spectral_norm"
AXOLOTL_MUON = (
    "Axolotl's Muon (Dion's) scales each matrix's step by sqrt(rows / columns), keel's "
    "(train.optimizer: muon) by 0.2 sqrt(max(rows, columns)) so that train.lr means AdamW's: "
    "their learning_rate would make other steps; set optimizer: adamw_torch here, or train "
    "with a keel config, train.optimizer: muon and an AdamW-sized train.lr"
)


def llamafactory_muon(build: Build, key: str, value) -> None:
    """use_muon: their Muon is Moonlight's, torch's Muon at AdamW's RMS, as keel's."""
    if not value:
        build.ignored(key, "false: AdamW")
        return
    why = "Muon on the weight matrices, AdamW on embeddings, output layer, norms and biases"
    if build.raw.get("weight_decay"):
        why += "; they decay norms and biases too, keel does not"
    build.put(key, "train.optimizer", "muon", why)


MIN_LR_SCHEDULER = "cosine_with_min_lr"


def scheduler(build: Build, key: str, value) -> None:
    """The Trainer's `lr_scheduler_type` name as train.scheduler (after train.warmup_*);
    cosine_with_min_lr is cosine with train.min_lr_ratio, from `lr_scheduler_kwargs`."""
    if value in _SCHEDULERS:
        why = "warmup, then constant" if value == "constant_with_warmup" else ""
        build.put(key, "train.scheduler", _SCHEDULERS[value], why)
    elif value == MIN_LR_SCHEDULER and not build.raw.get("lr_scheduler_kwargs"):
        why = "needs lr_scheduler_kwargs min_lr_rate or min_lr (the Trainer stops without)"
        build.refused(key, f"{value}: {why}")
    elif value == MIN_LR_SCHEDULER:
        build.put(key, "train.scheduler", "cosine", "down to lr x train.min_lr_ratio")
    else:
        names = ", ".join([*_SCHEDULERS, MIN_LR_SCHEDULER])
        build.refused(key, f"{value!r}: keel's schedules are {names} (after train.warmup_*)")


def scheduler_kwargs(build: Build, key: str, value, *, lr: float, scheduler_key: str) -> None:
    """The Trainer's `lr_scheduler_kwargs`: cosine_with_min_lr's floor (min_lr_rate, or
    min_lr over the peak `lr`) as train.min_lr_ratio; keel's other schedules take none."""
    if not build.mapping(key, value, empty="empty", what="a mapping of the schedule's arguments"):
        return
    if build.raw.get(scheduler_key) != MIN_LR_SCHEDULER:
        build.refused(
            key,
            f"keel's schedules take no arguments; only {MIN_LR_SCHEDULER}'s "
            f"min_lr_rate or min_lr are read (train.min_lr_ratio)",
        )
        return
    floor = dict(value)
    others = {k: v for k, v in floor.items() if k not in ("min_lr_rate", "min_lr", "num_cycles")}
    if (
        floor.get("num_cycles", 0.5) != 0.5
        or others
        or len(floor.keys() & {"min_lr_rate", "min_lr"}) != 1
    ):
        build.refused(
            key,
            f"{value!r}: keel reads one of min_lr_rate or min_lr (a half cosine, num_cycles "
            f"0.5); write train.min_lr_ratio for the floor as a fraction of the peak lr",
        )
    elif "min_lr_rate" in floor:
        build.put(key, "train.min_lr_ratio", floor["min_lr_rate"], "min_lr_rate")
    elif not isinstance(lr, int | float) or not isinstance(floor["min_lr"], int | float):
        build.refused(key, f"min_lr {floor['min_lr']!r} over a learning_rate of {lr!r}: numbers")
    else:
        ratio = floor["min_lr"] / lr
        build.put(key, "train.min_lr_ratio", ratio, f"min_lr {floor['min_lr']} / lr {lr}")


def save_strategy(build: Build, key: str, value) -> None:
    """The Trainer's `save_strategy`: keel saves every output.save_every steps."""
    if value == "no":
        build.put(key, "output.save_every", 0, "no: the final save only")
    elif value == "steps":
        build.ignored(key, "steps: save_steps sets output.save_every")
    else:
        build.refused(key, f"{value!r}: keel saves every output.save_every steps (save_steps)")


def eval_strategy(build: Build, key: str, value) -> None:
    """The Trainer's `eval_strategy` (`evaluation_strategy`, its old name): keel evaluates
    every train.eval_every steps or train.evals_per_epoch times an epoch."""
    if value == "steps":
        build.ignored(key, "steps: eval_steps sets train.eval_every")
    elif value == "no":
        build.ignored(
            key,
            "no: keel evaluates at the end when there is evaluation data (val_size, eval_dataset)",
        )
    elif value == "epoch" and build.raw.get("eval_steps"):
        build.ignored(key, "epoch: eval_steps is set too, and sets train.eval_every")
    elif value == "epoch":
        build.put(key, "train.evals_per_epoch", 1)
    else:
        build.refused(key, f"{value!r}: keel evaluates every train.eval_every steps (eval_steps)")


def streaming(build: Build, key: str, value) -> None:
    """Their `streaming` (both dialects): read the datasets as training goes."""
    if value:
        build.put(key, "data.streaming", True, "read, checked and tokenized as training goes")
    else:
        build.ignored(key, "false: keel's default")


def at_their_default(build: Build, key: str, value, default) -> None:
    """One of their settings keel has no key for: ignored at their `default` (it asks for
    nothing keel does differently), refused otherwise, naming the default."""
    same = value == default and isinstance(value, bool) == isinstance(default, bool)
    if same or (value is None and default is None):
        build.ignored(key, f"{value!r}: their default, nothing keel does differently")
    else:
        build.refused(
            key,
            f"{value!r}: a setting of theirs keel has no counterpart for (their default, "
            f"{default!r}, is the only value keel follows); remove it",
        )
