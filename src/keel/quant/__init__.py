"""Low-bit storage for what does not train: QLoRA's frozen base and 8/4-bit optimizer state.

torchao is an optional dependency (`pip install 'keel[qlora]'`); this package is the one
place that imports it, so a missing or noisy install is reported the same way everywhere.
"""

from __future__ import annotations

import importlib
import logging

from keel.errors import ConfigError

TORCHAO_PIN = "torchao>=0.18"


def import_torchao(module: str, *, needed_for: str):
    """`import torchao.<module>` quietly, or a ConfigError naming `needed_for` and the fix.

    torchao's own import logs a warning for every CUDA kernel library it cannot load on a
    CPU-only torch; those say nothing about what keel uses, so they are silenced.
    """
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(f"torchao.{module}")
    except ImportError as exc:
        raise ConfigError(
            [
                f"{needed_for} needs torchao, which is not importable here ({exc}); "
                f"install it with pip install '{TORCHAO_PIN}' (or pip install 'keel[qlora]')"
            ]
        ) from None
    finally:
        logger.setLevel(level)
