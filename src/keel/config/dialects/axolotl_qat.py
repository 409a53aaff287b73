"""Axolotl's quantization-aware training (`qat:`, torchao) as keel's method.qat, the
schedule keys their QAT examples set beside it, and the quantization a checkpoint loads
with (`model_quantization_config`: gpt-oss's MXFP4)."""

from __future__ import annotations

from keel.config.dialects.build import Build

_FP8 = ("float8_e4m3fn", "fp8", "float8")
# (their weight_dtype, activation_dtype) -> keel's scheme: the same torchao PTQ config
_SCHEMES = {("int4", "int8"): "int8-int4", ("int4", None): "int4"} | {
    ("float8_e4m3fn", "float8_e4m3fn"): "fp8"
}
_FP4 = (
    "torchao's FP4 QAT runs the FP4 matmuls themselves (Blackwell GPUs); keel's schemes are "
    "int8-int4, int4 and fp8"
)


def _qat(build: Build, key: str, value) -> None:
    if not build.mapping(key, value, empty="empty: no QAT", what="a mapping (weight_dtype, ...)"):
        return
    if build.raw.get("adapter"):
        build.refused(
            key, "QAT trains the weights themselves, not an adapter (Axolotl refuses it too)"
        )
        return
    weights, activations = (_dtype(value.get(k)) for k in ("weight_dtype", "activation_dtype"))
    weights = weights or "int8"  # their default
    scheme = _SCHEMES.get((weights, activations))
    pair = f"weight_dtype {weights}, activation_dtype {activations}"
    if scheme is None:
        fp4 = "fp4" in f"{weights}{activations}"
        build.refused(
            key,
            f"{pair}: "
            + (_FP4 if fp4 else f"not a scheme keel trains for; {_FP4[_FP4.index('keel') :]}"),
        )
        return
    build.put(
        f"{key}.weight_dtype",
        "method.qat.scheme",
        scheme,
        f"{pair}: rounded as torchao's own QAT derives from its {scheme} config",
    )
    if "activation_dtype" in value:
        build.mapped(f"{key}.activation_dtype", "method.qat.scheme")
    for name, setting in value.items():
        dotted = f"{key}.{name}"
        if name == "group_size":
            build.put(dotted, "method.qat.group_size", 32 if setting is None else setting)
        elif name == "fake_quant_after_n_steps":
            if setting:
                build.put(dotted, "method.qat.start_step", setting, "the steps before it unrounded")
            else:
                build.ignored(dotted, f"{setting!r}: rounded from the first step")
        elif name == "quantize_embedding":
            if setting:
                build.refused(dotted, "keel rounds the decoder layers' linear layers only")
            else:
                build.ignored(dotted, f"{setting!r}: the embeddings stay as they are")
        elif name not in ("weight_dtype", "activation_dtype"):
            build.refused(dotted, "an Axolotl QAT key keel has no counterpart for; remove it")


def _dtype(value) -> str | None:
    return "float8_e4m3fn" if value in _FP8 else value


def _cosine_constant_lr_ratio(build: Build, key: str, value) -> None:
    if not value or not build.raw.get("cosine_min_lr_ratio"):
        build.ignored(
            key,
            f"{value!r}: Axolotl holds no constant phase then (it needs a non-zero ratio and cosine_min_lr_ratio)",
        )
    else:
        build.refused(
            key,
            "a cosine that reaches its floor early and stays there is not a keel schedule; "
            "remove it (keel's cosine reaches train.min_lr_ratio at the last step)",
        )


def _not_theirs(build: Build, key: str, value) -> None:
    build.ignored(
        key, "not an Axolotl option: Axolotl reads no such key (its floor is cosine_min_lr_ratio)"
    )


def _model_quantization(build: Build, key: str, value) -> None:
    """transformers' quantization config for loading the base: Mxfp4Config (gpt-oss), which
    keel always dequantizes while loading; any other refused."""
    if key == "model_quantization_config_kwargs":
        if build.raw.get("model_quantization_config") == "Mxfp4Config":
            build.ignored(key, "keel dequantizes MXFP4 experts while loading, always")
        else:
            build.refused(key, "read with model_quantization_config (which see)")
    elif value == "Mxfp4Config":
        build.ignored(
            key,
            "keel dequantizes a gpt-oss checkpoint's MXFP4 experts to model.dtype while "
            "loading (as Mxfp4Config(dequantize=True) does) and trains them there",
        )
    else:
        build.refused(
            key,
            f"{value!r}: keel loads MXFP4 checkpoints (dequantized) and quantizes with "
            f"adapter: qlora; other quantized checkpoints are not read",
        )


QAT_HANDLERS = {
    "model_quantization_config": _model_quantization,
    "model_quantization_config_kwargs": _model_quantization,
    "qat": _qat,
    "cosine_constant_lr_ratio": _cosine_constant_lr_ratio,
    "eta_min": _not_theirs,
}
