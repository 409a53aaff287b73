"""Images of a row → image tokens, for the encoders of a vision-language run.

A row's `<image>` placeholders are replaced, in order, by the family's text for each image
(keel.models.vision.family.PreparedImage.text: its special tokens, one per image feature)
before the conversation is rendered, so the chat template and the assistant-span masking see
the final text. After tokenizing, each image's token span is found from the character
offsets; its tokens are never targets, and a row is never cut inside one (it is dropped, with
the span named). Each kept image becomes one blob (`keel.models.vision.blobs.pack` of its
tensors: decoded and resized here, once, and cached with the tokens), and families with 3-D
rotary positions (M-RoPE) get `rope_positions`, 3 per token, (t, h, w) interleaved.

Image files are read relative to the dataset's folder; their identities (path, size, mtime)
go into the cache's manifest (keel.data.cache), since the data files only name them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from keel.data.formats import Example, RowError, check_image_count
from keel.data.template import assistant_spans, render, token_mask
from keel.errors import ImageError
from keel.models.vision.family import PLACEHOLDER, PreparedImage

if TYPE_CHECKING:
    from keel.data.encode import EncodeSettings
    from keel.models.vision import VisionProcessing


@dataclass(frozen=True)
class ImageTokens:
    """The images of one tokenized sequence: each one's tensors and token span [start, end)."""

    prepared: tuple[PreparedImage, ...]
    spans: tuple[tuple[int, int], ...]
    files: tuple[str, ...] = ()  # the image files read (absolute paths), for the cache

    def cut(self, cutoff: int) -> ImageTokens:
        """The images wholly inside the first `cutoff` tokens. RowError naming the image
        when the cut falls inside one (a row is never cut inside an image)."""
        for k, (start, end) in enumerate(self.spans):
            if start < cutoff < end:
                raise RowError(
                    f"cutoff_len {cutoff} falls inside image {k + 1} (tokens {start}-{end - 1}); "
                    f"a row is never cut inside an image: dropped (raise data.cutoff_len, or "
                    f"lower model.vision.image_max_pixels for fewer image tokens)"
                )
        kept = sum(end <= cutoff for _, end in self.spans)
        return replace(self, prepared=self.prepared[:kept], spans=self.spans[:kept])

    def blobs(self) -> list[bytes]:
        from keel.models.vision import blobs

        return [blobs.pack(image.tensors) for image in self.prepared]

    def rope_positions(self, vision: VisionProcessing, ids: list[int]) -> list[int]:
        """The sample's [3, T] M-RoPE positions, transposed and flattened (t, h, w per token)."""
        images = [image.tensors for image in self.prepared]
        positions = vision.family.rope_positions(ids, images, vision.model_config)
        return positions.t().reshape(-1).tolist()


def image_columns(vision: VisionProcessing, sequences: list[tuple[list[int], ImageTokens]]):
    """`image_blobs` (token order, sequence after sequence) and, for M-RoPE families,
    `rope_positions` of the sequences laid end to end, each with its own positions."""
    columns = {"image_blobs": [b for _, images in sequences for b in images.blobs()]}
    if vision.family.rope == "mrope":
        columns["rope_positions"] = [
            p for ids, images in sequences for p in images.rope_positions(vision, ids)
        ]
    return columns


def vision_features(vision: VisionProcessing | None) -> dict:
    """The extra encoded columns of a vision run ({} for a text model)."""
    from datasets import List, Value

    if vision is None:
        return {}
    extra = {"image_blobs": List(Value("large_binary")), "image_files": List(Value("string"))}
    if vision.family.rope == "mrope":
        extra["rope_positions"] = List(Value("int32"))
    return extra


def refuse_images(example: Example) -> None:
    """A text model's run: a row with images cannot be trained on (RowError)."""
    if example.images:
        raise RowError(
            f"has {len(example.images)} image(s), but model.path is a text model; images need "
            f"a vision-language model (e.g. Qwen2-VL, LLaVA)"
        )


def encode_with_images(
    tokenizer, settings: EncodeSettings, example: Example, last_only: bool = False
) -> tuple[list[int], list[bool], ImageTokens]:
    """Token ids, trained mask and images of an example; image tokens are never trained.
    `last_only`: only the last (assistant) message is trained (a preference answer)."""
    content = example.content
    texts = [content] if isinstance(content, str) else [m["content"] for m in content]
    # a vision model reads every placeholder as an image (rows without images included)
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    check_image_count(
        placeholders, len(example.images), settings.spec.columns.get("images") or "images"
    )
    prepared = prepare_images(settings.vision, example.images, settings.media_dir)
    expanded = expand_placeholders(content, prepared)
    text, ids, mask, offsets = _tokenize(tokenizer, settings, expanded, last_only)
    if settings.train_on_prompt:
        mask = [True] * len(ids)
    spans = image_spans(text, offsets, prepared)
    _check_image_tokens(tokenizer, settings.vision, ids, spans, prepared)
    for start, end in spans:
        mask[start:end] = [False] * (end - start)
    files = tuple(str(f) for f in (image_file(r, settings.media_dir) for r in example.images) if f)
    return ids, mask, ImageTokens(tuple(prepared), tuple(spans), files)


def prepare_images(vision: VisionProcessing, refs: tuple, base_dir: Path | None) -> list:
    """Decode and prepare each referenced image; a bad image rejects the row (RowError)."""
    from keel.models.vision.images import load_image

    if not refs:
        return []
    try:
        pictures = [load_image(ref, base_dir) for ref in refs]
    except ImageError as e:
        raise RowError(str(e)) from None
    return vision.prepare_images(pictures)


def expand_placeholders(content: list[dict] | str, prepared: list[PreparedImage]):
    """`content` with its k-th `<image>` placeholder replaced by the k-th image's text."""
    texts = iter(image.text for image in prepared)

    def expand(text: str) -> str:
        head, *rest = text.split(PLACEHOLDER)
        return head + "".join(next(texts) + part for part in rest)

    if isinstance(content, str):
        return expand(content)
    return [{**m, "content": expand(m["content"])} for m in content]


def _tokenize(tokenizer, settings: EncodeSettings, content, last_only: bool):
    """(text, ids, trained mask, character offsets) as keel.data.template encodes it: a text
    (or, in pretraining, a rendered conversation) trains every token and ends with EOS; a
    conversation trains its assistant spans."""
    from keel.stages.registry import get_stage

    if isinstance(content, str) or get_stage(settings.stage).unit == "text":
        is_text = isinstance(content, str)
        text = content if is_text else render(tokenizer, settings.template, content)
        enc = tokenizer(text, add_special_tokens=is_text, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
            offsets.append((len(text), len(text)))
        return text, ids, [True] * len(ids), offsets
    text, spans = assistant_spans(tokenizer, settings.template, content, last_only)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = list(enc["offset_mapping"])
    return text, list(enc["input_ids"]), token_mask(offsets, spans), offsets


def image_spans(text: str, offsets: list, prepared: list[PreparedImage]) -> list[tuple[int, int]]:
    """Token span [start, end) of each image's text, found in order in the rendered `text`.
    Zero-width tokens (added specials such as BOS) belong to no image."""
    starts = [start if start < end else -1 for start, end in offsets]
    spans, at = [], 0
    for k, image in enumerate(prepared):
        found = text.find(image.text, at)
        if found < 0:
            raise RowError(
                f"image {k + 1} is missing from the rendered conversation (the chat template "
                f"dropped the message that holds its placeholder)"
            )
        at = found + len(image.text)
        inside = [i for i, start in enumerate(starts) if found <= start < at]
        spans.append((inside[0], inside[-1] + 1))
    return spans


def _check_image_tokens(tokenizer, vision, ids, spans, prepared) -> None:
    """Each image span holds as many image tokens as the image has features; otherwise the
    tokenizer does not know the family's image token as one token."""
    image_id = tokenizer.convert_tokens_to_ids(vision.family.image_token)
    for k, ((start, end), image) in enumerate(zip(spans, prepared, strict=True)):
        count = sum(token == image_id for token in ids[start:end])
        if count != image.num_tokens:
            raise RowError(
                f"image {k + 1} is {image.num_tokens} image features but its text tokenizes to "
                f"{count} '{vision.family.image_token}' tokens: the tokenizer must have "
                f"'{vision.family.image_token}' as a special token (the model folder's tokenizer)"
            )


def portable_image_ref(ref, base_dir: Path | None) -> str:
    """A reference to image `ref` that JSON holds and `load_image` reads again from any
    working directory: a file's absolute path; an inline image (bytes, a dict of bytes, an
    in-memory image) as a PNG data URL of its decoded pixels. ImageError when unreadable."""
    import base64
    import io

    from keel.models.vision.images import load_image

    path = image_file(ref, base_dir)
    if path is not None:
        return str(path)
    if isinstance(ref, str):  # a data: URL already
        return ref
    encoded = io.BytesIO()
    load_image(ref, base_dir).save(encoded, format="PNG")
    return "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode("ascii")


def image_file(ref, base_dir: Path | None) -> Path | None:
    """The local file an image reference reads (None for inline data: a data: URL, bytes,
    an in-memory image), resolved as keel.models.vision.images reads it."""
    if isinstance(ref, dict):
        return image_file(ref.get("path"), base_dir) if ref.get("bytes") is None else None
    if not isinstance(ref, str | Path) or str(ref).startswith("data:"):
        return None
    text = str(ref)
    path = Path(unquote(urlparse(text).path)) if text.startswith("file://") else Path(text)
    path = path.expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path.resolve()
