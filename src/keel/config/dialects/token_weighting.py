"""Their token-weighted fine-tuning losses as keel's train.token_weighting: LLaMA-Factory's
use_dft_loss and use_eaft_loss (eaft_alpha), Axolotl's use_eaft (eaft_alpha, eaft_k).

Both weigh each target token's cross-entropy by a factor held constant. LLaMA-Factory's EAFT
divides the top-20 entropy by 3.0 (about ln 20, as keel divides by ln k); Axolotl's leaves it
unnormalised, so its loss and gradients are ln(k)^alpha times keel's: keel clips gradients
at max_grad_norm over that factor, where AdamW's steps, which a constant factor on the
gradients does not change, stay the same at every step.
"""

from __future__ import annotations

import math

from keel.config.dialects.axolotl_training import yaml_number
from keel.config.dialects.build import Build

EVAL_LOSS = (
    "keel's eval_loss is the plain cross-entropy (theirs is weighted as training is); "
    "training logs ce_loss, the unweighted loss, beside the weighted one"
)
# LLaMA-Factory's EAFT: the top-20 entropy over 3.0; keel's over ln 20 = 2.996
LLAMAFACTORY_EAFT_TOP_K = 20
LLAMAFACTORY_EAFT_DIVISOR = 3.0
AXOLOTL_EAFT_ALPHA, AXOLOTL_EAFT_K = 1.0, 20  # their defaults for eaft_alpha, eaft_k
AXOLOTL_MAX_GRAD_NORM = 1.0  # HF's default, which Axolotl keeps


def llamafactory_weighting(build: Build, key: str, value) -> None:
    """use_dft_loss, use_eaft_loss: read by their sft trainer, DFT first."""
    if not value:
        build.ignored(key, "false: the plain cross-entropy, keel's default")
    elif build.stage != "sft":
        build.ignored(key, f"true with stage {build.stage}: only their sft trainer reads it")
    elif key == "use_eaft_loss" and build.raw.get("use_dft_loss"):
        build.ignored(key, "use_dft_loss is on too, and LLaMA-Factory's DFT takes precedence")
    elif key == "use_dft_loss":
        build.put(
            key, "train.token_weighting", "dft", f"each token by its probability; {EVAL_LOSS}"
        )
    else:
        alpha = build.raw.get("eaft_alpha", 1.0)
        gap = (math.log(LLAMAFACTORY_EAFT_TOP_K) / LLAMAFACTORY_EAFT_DIVISOR) ** alpha
        build.put(
            key,
            "train.token_weighting",
            "eaft",
            f"the top-{LLAMAFACTORY_EAFT_TOP_K} entropy over ln {LLAMAFACTORY_EAFT_TOP_K}; "
            f"they divide by {LLAMAFACTORY_EAFT_DIVISOR:g}, so their weights are "
            f"{1 - gap:.2%} smaller; {EVAL_LOSS}",
        )


def llamafactory_eaft_alpha(build: Build, key: str, value) -> None:
    raw = build.raw
    if raw.get("use_eaft_loss") and not raw.get("use_dft_loss") and build.stage == "sft":
        build.put(key, "train.eaft_alpha", value)
    else:
        build.ignored(key, "read with use_eaft_loss only (and without use_dft_loss)")


def _axolotl_eaft(raw: dict) -> tuple[float, int] | None:
    """(alpha, k) of an Axolotl config whose EAFT is on, None when it is off."""
    if not raw.get("use_eaft"):
        return None
    alpha, k = raw.get("eaft_alpha"), raw.get("eaft_k")
    return float(AXOLOTL_EAFT_ALPHA if alpha is None else alpha), int(
        AXOLOTL_EAFT_K if k is None else k
    )


def _axolotl_scale(raw: dict) -> float:
    """Axolotl's EAFT loss over keel's: ln(k)^alpha (1 without EAFT)."""
    eaft = _axolotl_eaft(raw)
    return 1.0 if eaft is None else math.log(eaft[1]) ** eaft[0]


def axolotl_eaft(build: Build, key: str, value) -> None:
    """use_eaft: Axolotl's causal trainer (sft and pretraining) computes it."""
    if not value:
        build.ignored(key, "false: the plain cross-entropy, keel's default")
        return
    if build.stage not in ("pt", "sft"):
        build.ignored(key, f"true with {build.stage}: Axolotl's EAFT replaces sft's loss only")
        return
    scale = _axolotl_scale(build.raw)
    build.put(
        key,
        "train.token_weighting",
        "eaft",
        f"Axolotl's entropy is unnormalised: its loss and gradients are {scale:.4g} times "
        f"keel's, whose max_grad_norm is divided by that; {EVAL_LOSS}",
    )
    if build.raw.get("max_grad_norm") is None:
        build.kept(
            "train.max_grad_norm",
            AXOLOTL_MAX_GRAD_NORM / scale,
            f"Axolotl's {AXOLOTL_MAX_GRAD_NORM} over {scale:.4g}, the factor of its EAFT loss",
        )


def axolotl_eaft_setting(build: Build, key: str, value) -> None:
    """eaft_alpha, eaft_k."""
    if build.raw.get("use_eaft") and build.stage in ("pt", "sft"):
        target = "train.eaft_alpha" if key == "eaft_alpha" else "train.eaft_top_k"
        build.put(key, target, value)
    else:
        build.ignored(key, "read with use_eaft only")


def axolotl_max_grad_norm(build: Build, key: str, value) -> None:
    scale = _axolotl_scale(build.raw) if build.stage in ("pt", "sft") else 1.0
    value = yaml_number(value) if isinstance(value, str) else value
    if scale == 1.0:
        build.put(key, "train.max_grad_norm", value)
    else:
        build.put(
            key,
            "train.max_grad_norm",
            value / scale,
            f"{value} over {scale:.4g}, the factor of Axolotl's unnormalised EAFT loss",
        )


LLAMAFACTORY_HANDLERS = {
    "use_dft_loss": llamafactory_weighting,
    "use_eaft_loss": llamafactory_weighting,
    "eaft_alpha": llamafactory_eaft_alpha,
}
AXOLOTL_HANDLERS = {
    "use_eaft": axolotl_eaft,
    "eaft_alpha": axolotl_eaft_setting,
    "eaft_k": axolotl_eaft_setting,
    "max_grad_norm": axolotl_max_grad_norm,
}
