"""Load Hugging Face tokenizers and causal-LM models from a local directory.

Paths reaching these functions are already resolved (see `keel.models.bundled`); nothing
here downloads. Loader failures become `ModelError`s that name the directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from keel.errors import ModelError
from keel.models.mxfp4 import is_mxfp4
from keel.models.safetensors_files import check_model_dir
from keel.models.vision import family_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_model_libraries(*, adapters: bool) -> None:
    """Import the library code every rank's preflight needs (transformers' model classes,
    peft when the method has adapters, datasets): several seconds of imports, done by every
    rank at once before rank 0 prepares alone, instead of by the others in turn after it."""
    import datasets  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    if adapters:
        import peft  # noqa: F401


def torch_dtype(name: str) -> torch.dtype | None:
    """Map a config dtype name to a torch dtype; "auto" gives None (the caller decides)."""
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ModelError(
            f"model.dtype: unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}"
        )
    return _DTYPES[name]


def load_tokenizer(model_dir: Path, *, trust_remote_code: bool = False):
    """Load the tokenizer saved in `model_dir`; pad_token falls back to eos_token.

    Batching needs a pad token; many chat models ship none. Padding positions are masked
    out of attention and loss, so reusing eos is safe.

    Always a Hugging Face tokenizer (`mistral_format=False`): with mistral-common installed
    (vllm brings it), transformers would load a Mistral repo that ships tekken.json through
    mistral-common's backend, which has no chat template, so the same config would train
    another chat format on that machine (keel's chatml fallback). The repo's tokenizer.json
    and chat template are what Mistral ships for Hugging Face; a tekken.json alone is
    converted to one.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=trust_remote_code, mistral_format=False
        )
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a tokenizer from {model_dir}: {e}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(
                f"the tokenizer in {model_dir} has neither a pad_token nor an eos_token; "
                "set one in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype | None,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
):
    """Load the model in `model_dir` on the CPU, in `dtype`: an `AutoModelForCausalLM`, or
    an `AutoModelForImageTextToText` for a vision-language family (`model_class`).

    dtype None keeps the dtype stored in the checkpoint. The model is left in whatever mode
    transformers gives it; training and inference callers set train()/eval() themselves.
    """
    from transformers import AutoConfig

    # An absolute path ends up in model.name_or_path, which PEFT copies into
    # adapter_config.json as base_model_name_or_path: `keel chat --model <output_dir>`
    # must find the base from any working directory.
    source = str(Path(model_dir).expanduser().resolve())
    # transformers fails on a truncated file with a traceback from the safetensors reader
    # (or a damaged file it could map); check every tensor's bytes first, naming the tensor.
    check_model_dir(Path(source))
    kind = "causal-LM"
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        auto_class, kind = model_class(config)
        extra = {}
        if is_mxfp4(config):  # gpt-oss: its experts in dtype, as keel trains and merges them
            from transformers import Mxfp4Config

            extra["quantization_config"] = Mxfp4Config(dequantize=True)
        return auto_class.from_pretrained(
            source,
            dtype=dtype if dtype is not None else "auto",
            # auto: transformers' own choice, sdpa where the architecture has it, else eager
            attn_implementation=None if attn_implementation == "auto" else attn_implementation,
            trust_remote_code=trust_remote_code,
            **extra,
        )
    except (OSError, ValueError, ImportError, SafetensorError) as e:
        raise ModelError(f"cannot load a {kind} model from {source}: {e}") from e


def model_class(config) -> tuple[type, str]:
    """(the transformers Auto class that builds `config`'s model, what to call it in
    messages): AutoModelForImageTextToText for a vision-language family (keel.models.vision),
    else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if family_of(config) is not None:
        return AutoModelForImageTextToText, "vision-language"
    return AutoModelForCausalLM, "causal-LM"


# A vision-language folder's files besides the model and the tokenizer: the image processor,
# the processor (image token counts), and the processor's chat template where it keeps one.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def copy_processor_files(model, out_dir: Path) -> list[str]:
    """Copy the processor files of the vision-language folder `model` was loaded from
    (its name_or_path; keel loads from absolute paths) into `out_dir`, so that
    AutoProcessor / AutoImageProcessor load the saved folder too. Files the tokenizer
    already wrote there are kept. Nothing for a text model; returns the names copied."""
    get_base = getattr(model, "get_base_model", None)
    hf_model = get_base() if callable(get_base) else model
    source = Path(str(getattr(hf_model, "name_or_path", "") or ""))
    if family_of(hf_model.config) is None or not source.is_dir():
        return []
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (Path(out_dir) / name).exists():
            shutil.copyfile(source / name, Path(out_dir) / name)
            copied.append(name)
    return copied


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpointing).

    transformers 5.x renamed `gradient_checkpointing_enable` (now a deprecated alias) to
    `activation_checkpointing_enable`; use the new name where it exists. Raises the
    model's ValueError when the architecture cannot do it.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
