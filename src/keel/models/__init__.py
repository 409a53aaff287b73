"""Load and save HF models and tokenizers, bundled models, and what trains (full/freeze/LoRA).

No torch.distributed here: parallelism is applied by `keel.distributed`.
"""

from keel.models.adapters import (
    apply_method,
    count_parameters,
    load_for_inference,
    save_model_dir,
)
from keel.models.bundled import BUNDLED_MODELS, resolve_model_path
from keel.models.loading import load_model, load_tokenizer, torch_dtype

__all__ = [
    "BUNDLED_MODELS",
    "apply_method",
    "count_parameters",
    "load_for_inference",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "save_model_dir",
    "torch_dtype",
]
