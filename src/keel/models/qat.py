"""Quantization-aware training on a model (method.qat): which layers round, whether they
can, and the log line. The rounding itself is torchao's (keel.quant.qat)."""

from __future__ import annotations

from torch import nn

from keel.config.schema import QatConfig
from keel.errors import ConfigError
from keel.models.trainable import find_decoder_layers
from keel.models.vision import family_of
from keel.quant import import_torchao
from keel.quant.qat import NEEDED_FOR, SCHEMES, prepare

# Int4WeightOnlyConfig's kernels take these group sizes only
INT4_GROUPS = (32, 64, 128, 256)


def fake_quantize(model: nn.Module, qat: QatConfig) -> int:
    """Round the decoder layers' linear layers of `model` (a full or freeze model, still on
    the meta device) as method.qat says; returns how many."""
    return prepare(find_decoder_layers(model), qat.scheme, qat.group_size)


def describe(qat: QatConfig, count: int) -> str:
    """The log line: what rounds, how, and what the output holds."""
    scheme = SCHEMES[qat.scheme]
    group = f", groups of {qat.group_size}" if scheme.grouped else ""
    start = f"; from step {qat.start_step + 1} on" if qat.start_step else ""
    return (
        f"QAT: {count} linear layers of the decoder train rounded as {qat.scheme}{group} "
        f"({scheme.summary}){start}; the output holds the trained weights unrounded, and "
        f"keel export --quantize applies the scheme"
    )


def qat_problems(model: nn.Module, qat: QatConfig) -> list[str]:
    """Why method.qat cannot run on `model` (the meta model, before the method), if it
    cannot: torchao missing, a vision-language model, group sizes that do not fit."""
    if qat.scheme == "none":
        return []
    try:
        import_torchao("quantization.qat", needed_for=NEEDED_FOR)
    except ConfigError as exc:
        return list(exc.problems)
    if family_of(model.config) is not None:
        return [
            f"method.qat.scheme = {qat.scheme}: {type(model).__name__} is a vision-language "
            f"model; keel's QAT rounds text models' decoder layers only"
        ]
    layers = find_decoder_layers(model)
    if layers is None:
        return [f"method.qat: cannot find the decoder layers of {type(model).__name__}"]
    if not SCHEMES[qat.scheme].grouped:
        return []
    if qat.scheme == "int4" and qat.group_size not in INT4_GROUPS:
        return [
            f"method.qat.group_size = {qat.group_size}: int4's kernels take "
            f"{', '.join(map(str, INT4_GROUPS))}"
        ]
    widths = sorted({m.in_features for m in layers.modules() if isinstance(m, nn.Linear)})
    misfits = [w for w in widths if w % qat.group_size]
    if not misfits:
        return []
    return [
        f"method.qat.group_size = {qat.group_size} does not divide the input features of "
        f"{type(model).__name__}'s linear layers ({', '.join(map(str, misfits))}); use a "
        f"size that divides {', '.join(map(str, widths))}"
    ]
