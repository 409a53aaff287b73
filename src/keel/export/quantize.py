"""`keel export --quantize`: the exported decoder layers' linear weights as torchao's
quantized tensors, with the scheme a QAT run trained for (method.qat) or a named one
(post-training quantization); transformers loads the folder back with torchao installed.

The layers and the torchao config are the ones QAT rounded in training
(keel.models.qat), so the quantized model computes what the QAT run's model computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import yaml
from torch import nn

from keel.config.schema import QatConfig
from keel.errors import ModelError
from keel.export.sources import Sources
from keel.models.qat import qat_problems
from keel.models.trainable import find_decoder_layers
from keel.quant import import_torchao
from keel.quant.qat import NEEDED_FOR, SCHEMES, torchao_config

Log = Callable[[str], None]
TRAINED = "trained"  # --quantize without a value: the run's own method.qat
RUN_CONFIG = "config.yaml"  # what a keel output folder keeps of its run's config


def quantize_scheme(requested: str, sources: Sources, model: str) -> QatConfig:
    """The scheme `--quantize [requested]` means for the export of `model`: the run's
    method.qat, or the named scheme (with the run's group size if it trained for it)."""
    trained = _trained_qat(sources)
    if requested == TRAINED:
        if trained is None:
            raise ModelError(
                f"--quantize: {model} was not trained with method.qat (its config names no "
                f"QAT scheme); name one for post-training quantization: --quantize "
                f"{' | '.join(SCHEMES)}"
            )
        return trained
    if requested not in SCHEMES:
        raise ModelError(
            f"--quantize {requested}: not a scheme keel quantizes with; use one of "
            f"{', '.join(SCHEMES)}, or no value for the scheme a QAT run trained for"
        )
    if trained is not None and trained.scheme != requested:
        raise ModelError(
            f"--quantize {requested}: {model} was trained for {trained.scheme} "
            f"(method.qat); quantizing it otherwise throws that training away: leave the "
            f"value out, or name {trained.scheme}"
        )
    return trained or QatConfig(scheme=requested)


def quantize_model(model: nn.Module, qat: QatConfig, log: Log) -> dict:
    """Quantize `model`'s decoder layers' linear weights in place as `qat` says, and set
    what makes save_pretrained write them as torchao tensors; returns the provenance."""
    problems = qat_problems(model, qat)
    if problems:
        raise ModelError("--quantize: " + "; ".join(problems))
    quantization = import_torchao("quantization", needed_for=NEEDED_FOR)
    from transformers import TorchAoConfig
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    layers = {id(module) for module in find_decoder_layers(model).modules()}
    rounded = {id(m) for m in model.modules() if isinstance(m, nn.Linear) and id(m) in layers}
    config = torchao_config(qat.scheme, qat.group_size)
    try:
        quantization.quantize_(model, config, filter_fn=lambda m, _name: id(m) in rounded)
    except (ImportError, RuntimeError, AssertionError, NotImplementedError) as exc:
        raise ModelError(_unavailable(qat, exc)) from None
    kept = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in rounded
    ]
    ao_config = TorchAoConfig(quant_type=config, modules_to_not_convert=kept or None)
    model.config.quantization_config = ao_config
    model.hf_quantizer = TorchAoHfQuantizer(ao_config)
    log(
        f"quantized {len(rounded)} linear layers of the decoder as {qat.scheme} "
        f"({SCHEMES[qat.scheme].summary}); kept: {', '.join(kept) or 'none'}"
    )
    return asdict(qat) | {"layers": len(rounded)}


def _trained_qat(sources: Sources) -> QatConfig | None:
    """The method.qat the export's source trained with: a checkpoint's meta.json, or a keel
    output folder's config.yaml; None for anything else, or a run without QAT."""
    if sources.checkpoint is not None:
        qat = sources.checkpoint.method.qat
    else:
        path = sources.base_dir / RUN_CONFIG
        try:
            run = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
            qat = QatConfig(**run["method"]["qat"])
        except (yaml.YAMLError, TypeError, KeyError, OSError):
            return None
    return None if qat.scheme == "none" else qat


def _unavailable(qat: QatConfig, exc: Exception) -> str:
    """Why torchao could not quantize here, and the way around it."""
    return (
        f"--quantize {qat.scheme}: torchao cannot make {qat.scheme}'s quantized tensors on "
        f"this machine ({type(exc).__name__}: {exc}); its kernels are CUDA's. Export without "
        f"--quantize and quantize as it loads on the GPU: transformers' "
        f"from_pretrained(folder, quantization_config=TorchAoConfig(quant_type=...)) with "
        f"{type(torchao_config(qat.scheme, qat.group_size)).__name__}"
        + (f"(group_size={qat.group_size})" if SCHEMES[qat.scheme].grouped else "()")
    )
