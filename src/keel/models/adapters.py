"""Choose what trains (full, freeze, LoRA, OFT), save the result, and load it back for inference.

Saved directories are ones other tools read as they are: a PEFT adapter directory, or a
full Hugging Face model directory in safetensors.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch

from keel.config.schema import (
    BUNDLED_PREFIX,
    LoraConfig,
    MethodConfig,
    OftConfig,
    VisionConfig,
)
from keel.errors import ModelError
from keel.models.bundled import resolve_model_path
from keel.models.experts import (
    expert_target_problems,
    fused_experts,
    retargeted_names,
)
from keel.models.hub import hub_source, is_hub_id
from keel.models.loading import copy_processor_files, load_model, load_tokenizer
from keel.models.peft_wrap import adapter_targets, full_modules, wrap_lora, wrap_oft
from keel.models.safetensors_files import ADAPTER_WEIGHTS, read_checked
from keel.models.trainable import (
    apply_freeze,
    find_decoder_layers,
    freeze_problems,
    short_names,
    unknown_names,
)
from keel.models.vision_parts import (
    apply_vision_switches,
    describe_parts,
    outside_vision,
    vision_family,
)
from keel.models.vocabulary import fit_vocabulary
from keel.models.weight_split import SPLITS, save_split_as_lora, splits_base

Log = Callable[[str], None]
# Module types PEFT's LoRA (and OFT) can wrap; a target name must match at least one of them.
_LORA_TYPES: tuple[type, ...] = (
    torch.nn.Linear,
    torch.nn.Embedding,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights count once."""
    params = list(model.parameters())  # parameters() already de-duplicates shared tensors
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable, sum(p.numel() for p in params)


def apply_method(
    model: torch.nn.Module,
    method: MethodConfig,
    log: Log = print,
    *,
    vision: VisionConfig | None = None,
) -> torch.nn.Module:
    """Mark what trains according to `method.type` and return the model to train.

    full: every parameter. freeze: the last `trainable_layers` decoder layers plus the
    modules named in `trainable_modules` and the parameters `trainable_params` match. lora
    and qlora: a PEFT LoRA wrapper (a new PeftModel around `model`; qlora's base is
    quantised later, by keel.quant); oft: a PEFT OFT wrapper. Anything `method_problems`
    finds raises one ModelError listing it all. A vision-language model's tower and
    projector train as `vision` (model.vision; None: its defaults) says, and an adapter
    adapts its language model only (keel.models.vision_parts).
    """
    problems = method_problems(model, method)
    if problems:
        if len(problems) == 1:
            raise ModelError(problems[0])
        raise ModelError(
            "\n".join(
                [f"method.type = {method.type} cannot be applied:", *(f"  - {p}" for p in problems)]
            )
        )
    family = vision_family(model)
    vision = vision or VisionConfig()
    if method.type == "full":
        model.requires_grad_(True)
    elif method.type == "freeze":
        apply_freeze(model, method.freeze, log)
    elif method.type == "oft":
        model = wrap_oft(model, method.oft, log, vision=vision)
    else:
        model = wrap_lora(model, method.lora, log, vision=vision)
    if family is not None:
        apply_vision_switches(model, family, vision, method.type)
    trainable, total = count_parameters(model)
    log(
        f"method {method.type}: {trainable:,} of {total:,} parameters trainable ({100 * trainable / total:.2f}%)"
    )
    if family is not None:
        log(describe_parts(model, family))
    return model


def method_problems(model: torch.nn.Module, method: MethodConfig) -> list[str]:
    """Every reason `apply_method(model, method)` would refuse, each naming its config key,
    value and fix; [] when it applies. The model is not changed, so a caller can collect
    these with other problems and report them all at once."""
    if method.type == "full":
        return []
    if method.type == "freeze":
        return freeze_problems(model, method.freeze)
    if method.uses_adapter:
        key = method.adapter_key
        return [
            *_target_problems(model, method.adapter, key),
            *_full_module_problems(model, method.adapter, key),
            *expert_target_problems(
                model, method.lora.target_parameters if method.uses_lora else []
            ),
            *(_tied_split_problems(model, method.lora) if method.uses_lora else []),
            *(_layer_problems(model, method.lora) if method.uses_lora else []),
        ]
    return [f"method.type = {method.type!r} is not one of full, freeze, lora, qlora, oft"]


def _layer_problems(model, lora: LoraConfig) -> list[str]:
    """method.lora.layers: indices of the model's decoder layers, each once."""
    if not lora.layers:
        return []
    layers = find_decoder_layers(model)
    count = len(layers) if layers is not None else 0
    wrong = sorted({i for i in lora.layers if not 0 <= i < count})
    problems = []
    if layers is None:
        problems.append(
            f"method.lora.layers = {lora.layers}: keel cannot find the decoder layers of "
            f"{type(model).__name__}; leave method.lora.layers empty (every layer)"
        )
    elif wrong:
        problems.append(
            f"method.lora.layers = {lora.layers}: {', '.join(map(str, wrong))} is not a decoder "
            f"layer index of this model (0..{count - 1})"
        )
    if len(set(lora.layers)) != len(lora.layers):
        problems.append(f"method.lora.layers = {lora.layers} names a layer twice")
    return problems


def _tied_split_problems(model, lora: LoraConfig) -> list[str]:
    """A start that splits the base weight (pissa, olora) on an output layer tied to the
    input embeddings would change the embeddings too: the model would not start as it was."""
    targets = adapter_targets(lora)
    outputs, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if lora.init not in SPLITS or targets == "all-linear" or outputs is None or inputs is None:
        return []  # PEFT's all-linear leaves the output layer out
    name = next((n for n, m in model.named_modules() if m is outputs), "")
    if outputs.weight is not inputs.weight or name.rsplit(".", 1)[-1] not in targets:
        return []
    return [
        f"method.lora.init = {lora.init} with {name} in method.lora.targets: its weight is the "
        f"input embeddings' too (tied), and splitting it would change them; leave it out of "
        f"the targets, or use method.lora.init default"
    ]


def lora_target_names(model: torch.nn.Module) -> list[str]:
    """Sorted short names of the modules LoRA could wrap (e.g. q_proj, v_proj)."""
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, _LORA_TYPES)}
    )


def _target_problems(model, settings: LoraConfig | OftConfig, key: str) -> list[str]:
    """`key`: the section's config key (method.lora, method.oft), for the messages."""
    targets = adapter_targets(settings)
    if targets == "all-linear":
        return []
    if not targets:
        return [
            f"{key}.targets is empty; list module names (e.g. [q_proj, v_proj]) or use all-linear"
        ]
    wrappable = [n for n, m in model.named_modules() if n and isinstance(m, _LORA_TYPES)]
    family = vision_family(model)
    where = ""
    if family is not None:  # adapters adapt a vision-language model's language model only
        wrappable = outside_vision(family, wrappable)
        where = " outside the vision tower and projector"
    unknown = unknown_names(targets, wrappable)
    experts = sorted(set(targets) & retargeted_names(model))
    if experts:
        return [
            f"{key}.targets = {settings.targets}: on {type(model).__name__} PEFT reads "
            f"{', '.join(experts)} as the routed experts or router ({', '.join(fused_experts(model))}), "
            f"which keel's adapters do not adapt; leave {'them' if len(experts) > 1 else 'it'} out (all-linear adapts "
            f"the rest), or train the experts with method.type full or freeze"
        ]
    if not unknown:
        return []
    names = sorted({n.rsplit(".", 1)[-1] for n in wrappable})
    return [
        f"{key}.targets = {settings.targets}: no linear module named {'; '.join(unknown)}"
        f"{where}; this model has: {', '.join(names)} (or use all-linear)"
    ]


def _full_module_problems(model, settings: LoraConfig | OftConfig, key: str) -> list[str]:
    """<key>.modules_to_save names modules of the model (outside a vision-language model's
    tower and projector, which model.vision trains), none of them adapted by the adapter."""
    wanted = settings.modules_to_save
    if not wanted:
        return []
    names = [n for n, _ in model.named_modules() if n]
    family = vision_family(model)
    if family is not None:
        names = outside_vision(family, names)
    problems = []
    unknown = unknown_names(wanted, names)
    if unknown:
        problems.append(
            f"{key}.modules_to_save: no module named {'; '.join(unknown)} in "
            f"{type(model).__name__}{' outside the vision parts' if family else ''}; this "
            f"model has: {short_names(names)}"
        )
    if key == "method.oft" and full_modules(model, settings, lambda _m: None)[1]:
        problems.append(
            f"{key}.modules_to_save = {wanted} (or added tokens) trains embeddings tied to the "
            f"output layer, which PEFT's OFT cannot keep tied (the two copies would train "
            f"apart, and a merged model ties them back); use method.type lora, whose PEFT "
            f"keeps them one matrix, or a model with an output layer of its own"
        )
    targets = adapter_targets(settings)
    both = [] if targets == "all-linear" else sorted(set(wanted) & set(targets))
    if both:
        problems.append(
            f"{key}.modules_to_save and {key}.targets both name {', '.join(both)}; "
            f"a module trains in full or through the adapter, not both: remove it from one"
        )
    return problems


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def save_model_dir(
    model, tokenizer, out_dir: Path, *, merged: bool = False, state_dict: dict | None = None
) -> None:
    """Write `model` and `tokenizer` (and a vision-language model's processor files) to
    `out_dir` in formats other tools load directly.

    A PeftModel is written as a PEFT adapter (adapter_config.json + adapter_model.safetensors;
    a PiSSA or OLoRA one converted to a LoRA on the original base: keel.models.weight_split);
    with merged=True a copy is merged instead and written as a full HF model, leaving the live
    model untouched. A plain model is written as a full HF model in safetensors. Pass the
    underlying module, not a DDP/FSDP wrapper. `state_dict` replaces the module's own
    tensors (e.g. full tensors gathered from shards); not with merged=True.
    """
    assert not (merged and state_dict is not None), "merge a model, not a state dict"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # PEFT picks an adapter's tensors by name, a tied output layer's trained copy under its
    # own (modules_to_save), so a PeftModel keeps every name.
    if state_dict is not None and not _is_peft(model):
        state_dict = _without_tied_copies(model, state_dict)
    if _is_peft(model) and merged:
        # merge_and_unload rewrites the base weights in place; the live model keeps training,
        # so merge a copy (costs one extra model in memory for the duration of the save).
        merged_model = copy.deepcopy(model).merge_and_unload()
        merged_model.save_pretrained(str(out_dir))
        del merged_model
    else:
        if _is_peft(model):
            for cfg in model.peft_config.values():
                base = cfg.base_model_name_or_path
                # Relative base paths break `keel chat --model <out_dir>` from elsewhere.
                if base and Path(base).is_dir():
                    cfg.base_model_name_or_path = str(Path(base).resolve())
        extra = {"save_embedding_layers": saves_embedding_layers(model)} if _is_peft(model) else {}
        model.save_pretrained(str(out_dir), state_dict=state_dict, **extra)
        if _is_peft(model) and splits_base(model):  # a plain LoRA on the original base
            save_split_as_lora(model, out_dir)
        if _is_peft(model):
            _name_hub_base(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    copy_processor_files(model, out_dir)  # a vision-language model's image processor


def saves_embedding_layers(peft_model) -> bool:
    """PEFT's save_embedding_layers as keel saves adapters. PEFT's own choice (auto) adds
    the base's whole embedding matrices to an adapter whose model has more rows than the
    base's config.json says; with added tokens those rows train in full and are saved as
    modules_to_save already. A LoRA on the embeddings keeps what PEFT does for it."""
    return any(".lora_embedding_A." in name for name, _ in peft_model.named_parameters())


def _name_hub_base(out_dir: Path) -> None:
    """Name a Hub base by its id and commit in the saved adapter_config.json and model card.

    A snapshot's path differs between machines; the id and commit do not (PEFT and keel read
    `revision` to fetch that commit). Rewritten after saving: while saving, PEFT reads the
    base's config.json, which the local path gives without asking the Hub.
    """
    config_file = out_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    hub = hub_source(base) if base else None
    if hub is None:
        return
    config["base_model_name_or_path"], config["revision"] = hub.repo_id, hub.commit
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = out_dir / "README.md"
    if card.is_file():
        card.write_text(card.read_text().replace(base, hub.repo_id))


def _without_tied_copies(model, state: dict) -> dict:
    """Drop the second name of tied weights (lm_head = embeddings), as save_pretrained does
    for a live model; an explicit state dict would otherwise store both."""
    first_name: dict[int, str] = {}
    duplicates = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            duplicates.add(name)
        else:
            first_name[id(param)] = name
    return {k: v for k, v in state.items() if k not in duplicates}


def load_for_inference(
    model: str,
    adapter: str | None,
    *,
    cache_dir: str | Path,
    dtype: torch.dtype | None = torch.float32,
    log: Log = print,
):
    """Load (model, tokenizer) in eval mode for chat or serving.

    `model` is "bundled:NAME", a full HF model dir, or a keel output dir holding an adapter
    (adapter_config.json; its base_model_name_or_path is loaded under it). `adapter` is an
    adapter dir to put on top of a full model. The tokenizer comes from the adapter dir when
    it has one (keel saves it there), else from the base.
    """
    adapter_dir = Path(adapter).expanduser() if adapter else None
    model_path = Path(model).expanduser()
    revision = "main"
    if not model.startswith(BUNDLED_PREFIX) and (model_path / "adapter_config.json").is_file():
        if adapter_dir is not None:
            raise ModelError(
                f"--model {model} already holds an adapter; can't also pass --adapter {adapter}. "
                "Pass the base model as --model, or drop --adapter."
            )
        adapter_dir = model_path
        model, revision = adapter_base(adapter_dir)
    if adapter_dir is not None and not (adapter_dir / "adapter_config.json").is_file():
        raise ModelError(
            f"--adapter {adapter_dir}: no adapter_config.json there; give a PEFT adapter dir"
        )
    if adapter_dir is not None and (adapter_dir / ADAPTER_WEIGHTS).is_file():
        read_checked(adapter_dir / ADAPTER_WEIGHTS)  # a truncated file: its name, no traceback
    base_dir = resolve_model_path(model, cache_dir, log, revision=revision)
    net = load_model(base_dir, dtype=dtype)
    tokenizer_dir = base_dir
    if adapter_dir is not None and (adapter_dir / "tokenizer_config.json").is_file():
        tokenizer_dir = adapter_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        fit_vocabulary(net, tokenizer, log)  # a run that added tokens trained more rows
        log(f"loading adapter {adapter_dir} on {base_dir}")
        net = PeftModel.from_pretrained(net, str(adapter_dir))
    net.eval()
    return net, tokenizer


def adapter_base(adapter_dir: Path) -> tuple[str, str]:
    """(the base model, its revision) an adapter names: a local folder, a bundled model, or
    a Hugging Face Hub id with the commit it was trained on."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ModelError(
            f"{adapter_dir}/adapter_config.json names no base model; "
            f"pass --model BASE_DIR --adapter {adapter_dir}"
        )
    if is_hub_id(base):
        return base, config.get("revision") or "main"
    if not base.startswith(BUNDLED_PREFIX) and not Path(base).expanduser().is_dir():
        raise ModelError(
            f"the base model of adapter {adapter_dir} ({base}) is not a local directory; "
            f"pass --model BASE_DIR --adapter {adapter_dir}"
        )
    return base, "main"
