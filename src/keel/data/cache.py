"""The prepared-data cache: a fingerprint of every input, and crash-safe save/load.

`<cache_dir>/data/<fingerprint>/` holds `train/` (and `eval/`) written by `save_to_disk`
plus `report.json`. It is written to a temporary sibling and renamed into place, so a crash
never leaves a half-written cache, and concurrent writers (several ranks) cannot collide:
the first rename wins and the others load what it wrote.

A vision-language run also fingerprints its image processing (`vision_fingerprint`), and
the cache keeps a manifest of the image files its rows read (`images.json`: path, size,
mtime): the data files only name the images, so a cache whose images changed since is
stale (`stale_image`) and prepared again. Inline images (data: URLs, bytes) are part of the
data files, which the fingerprint covers already.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

from keel.config.schema import DataConfig
from keel.data.report import DataReport
from keel.data.sources import Source
from keel.data.template import ChatTemplate

# bump when the layout or meaning of prepared rows changes (4: tool-calling rows are read,
# where 3 rejected them, so a cache of skipped rows must not be reused; 5: an answer's
# reasoning_content / thinking / reasoning reaches the template, where 4 dropped it; 6: a
# vision-language prompt row carries image_refs for the reward functions)
DATA_FORMAT_VERSION = 6
_HASH_CONTENT_BELOW = 16 << 20  # hash small files' bytes; size + mtime_ns for larger ones
IMAGE_MANIFEST = "images.json"


def file_signature(path: Path) -> dict:
    """Identity of a source file: its bytes when small, else its size and mtime."""
    st = path.stat()
    sig = {"path": str(path.resolve()), "size": st.st_size}
    if st.st_size < _HASH_CONTENT_BELOW:
        sig["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    else:
        sig["mtime_ns"] = st.st_mtime_ns
    return sig


def tokenizer_identity(tokenizer) -> dict:
    """What makes two tokenizers encode the same: the backend's JSON (or vocab) and specials."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "class": type(tokenizer).__name__,
        "sha256": hashlib.sha256(blob.encode()).hexdigest(),
        "eos": tokenizer.eos_token,
        "bos": tokenizer.bos_token,
    }


_DEFAULT_ROW_BYTES = next(f.default for f in fields(DataConfig) if f.name == "max_row_bytes")


def fingerprint(
    cfg: DataConfig,
    sources: list[Source],
    template: ChatTemplate,
    tokenizer,
    stage: str,
    seed: int,
) -> str:
    """sha256 over everything that can change the prepared rows or the report; `sources`:
    the training data's, then the evaluation data's (data.eval_datasets)."""
    payload = {
        "version": DATA_FORMAT_VERSION,
        "stage": stage,
        "seed": seed,
        "cutoff_len": cfg.cutoff_len,
        "overlength": cfg.overlength,
        "on_invalid": cfg.on_invalid,
        "packing": cfg.packing,
        "val_size": cfg.val_size,
        "template": template.text,
        "tokenizer": tokenizer_identity(tokenizer),
        "sources": [_source_identity(s) for s in sources],
    }
    for key in ("train_on_prompt", "mask_history", "deduplicate", "streaming"):  # added later:
        if getattr(cfg, key):  # when unset, data prepared before them keeps its fingerprint
            payload[key] = True
    if cfg.max_row_bytes != _DEFAULT_ROW_BYTES:  # it decides which rows are refused
        payload["max_row_bytes"] = cfg.max_row_bytes
    if cfg.min_len:  # which samples (and pieces) are dropped as short
        payload["min_len"] = cfg.min_len
    if cfg.mix != "concat":  # which rows of each dataset are drawn
        payload["mix"] = [cfg.mix, list(cfg.mix_weights)]
    blob = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _source_identity(source: Source) -> dict:
    held_out = {"key": source.key} if source.held_out else {}
    return {
        **held_out,  # added later: the training data's sources keep their identity
        "config": _entry_identity(source.config),
        "entry": source.entry,
        "format": source.format,
        "columns": source.columns,
        "tags": source.tags,
        "split": source.split,
        "num_samples": source.num_samples,
        "files": _files_identity(source),
    }


def vision_fingerprint(data_fingerprint: str, vision) -> str:
    """The fingerprint of a vision-language run: the data's, with what turns its images into
    tokens and tensors (the family, the image processor's settings, the model config)."""
    config = {
        k: v
        for k, v in vision.model_config.to_dict().items()
        if not k.startswith("_") and k != "transformers_version"
    }
    payload = {
        "data": data_fingerprint,
        "family": vision.family.name,
        "image_processor": type(vision.image_processor).__name__,
        "image_processor_settings": vision.image_processor.to_dict(),
        "model_config": config,
    }
    blob = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def image_manifest(paths) -> list[dict]:
    """Identity of each image file read (sorted, no repeats): path, size and mtime_ns."""
    out = []
    for path in sorted(set(paths)):
        st = os.stat(path)
        out.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def stale_image(path: Path) -> str | None:
    """Why the cache at `path` is stale: an image file its rows read has changed or gone;
    None when every one is as it was (or the cache read no image files)."""
    manifest = path / IMAGE_MANIFEST
    if not manifest.is_file():
        return None
    for entry in json.loads(manifest.read_text()):
        try:
            st = os.stat(entry["path"])
        except OSError:
            return f"image {entry['path']} is gone"
        if (st.st_size, st.st_mtime_ns) != (entry["size"], entry["mtime_ns"]):
            return f"image {entry['path']} changed"
    return None


def _entry_identity(entry) -> dict:
    """A dataset entry's settings. `revision`, `subset`, `files` and `drop_system` (added
    later) count only when they choose something, so data prepared, and checkpoints
    written, before they existed keep their fingerprint and still resume."""
    settings = asdict(entry)
    if settings.get("revision") == "main":
        del settings["revision"]
    for later in ("subset", "files", "drop_system"):
        if not settings.get(later):
            settings.pop(later, None)
    return settings


def _files_identity(source: Source) -> list:
    """A Hub dataset's files are fixed by its commit (their cache paths and mtimes differ
    between machines); local files by their bytes or size and mtime."""
    if source.hub is not None:
        return [source.hub.commit, *(source.hub.label(f) for f in source.files)]
    return [file_signature(f) for f in source.files]


def load_cached(path: Path):
    """(train, eval, report) from a complete cache dir, or None when there is none."""
    from datasets import load_from_disk

    if not (path / "report.json").is_file():
        return None
    report = DataReport.from_dict(json.loads((path / "report.json").read_text()))
    # no train/: the evaluation data of a run that streams its training data
    train = load_from_disk(str(path / "train")) if (path / "train").is_dir() else None
    eval_ = load_from_disk(str(path / "eval")) if (path / "eval").is_dir() else None
    return train, eval_, report


def save_cache(path: Path, train, eval_, report: DataReport, images: list[dict] = ()) -> None:
    """Write the cache to a temporary dir, then rename it to `path` (atomic). `images`: the
    image manifest (`image_manifest`), written when not empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name[:16]}-", dir=path.parent))
    try:
        if train is not None:
            train.save_to_disk(str(tmp / "train"))
        if eval_ is not None:
            eval_.save_to_disk(str(tmp / "eval"))
        if images:
            (tmp / IMAGE_MANIFEST).write_text(json.dumps(list(images), indent=1))
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "report.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
