"""Decode one image reference into an RGB PIL image, within size limits.

A reference is what datasets and requests carry: a path (relative to the dataset's folder), a
`file://` URL, a `data:image/...;base64,` URL, raw bytes, a dict {"path"/"bytes"} as
`datasets.Image` stores it, or an already decoded PIL image. Every failure is an `ImageError`
naming the reference (data turns it into a row rejection, the server into a 400).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from keel.errors import ImageError

MAX_IMAGE_BYTES = 64 * 1024 * 1024
MAX_IMAGE_PIXELS = 8192 * 8192  # decompression bombs: refuse before decoding the pixels


def load_image(ref, base_dir: Path | None = None) -> Image.Image:
    """The image `ref` points at, decoded and converted to RGB."""
    if isinstance(ref, Image.Image):
        _check_pixels(ref, _describe(ref))
        return ref.convert("RGB")
    data, name = _read_bytes(ref, base_dir)
    return _decode(data, name)


def _describe(ref) -> str:
    if isinstance(ref, Image.Image):
        return f"a {ref.width}x{ref.height} in-memory image"
    if isinstance(ref, (bytes, bytearray)):
        return f"{len(ref)} bytes of image data"
    text = str(ref)
    # A long path or data URL keeps its start and its end: the file name is at the end.
    return repr(text if len(text) <= 80 else text[:30] + "..." + text[-40:])


def _read_bytes(ref, base_dir: Path | None) -> tuple[bytes, str]:
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return _checked_size(bytes(ref["bytes"]), _describe(ref["bytes"])), "image bytes"
        if ref.get("path"):
            return _read_bytes(ref["path"], base_dir)
        raise ImageError(f"image {_describe(ref)}: a dict image needs 'path' or 'bytes'")
    if isinstance(ref, (bytes, bytearray)):
        return _checked_size(bytes(ref), _describe(ref)), _describe(ref)
    if isinstance(ref, (str, Path)):
        text = str(ref)
        if text.startswith("data:"):
            return _data_url_bytes(text), _describe(text)
        return _file_bytes(_file_path(text, base_dir), _describe(text)), _describe(text)
    raise ImageError(f"image reference of type {type(ref).__name__} is not supported: {ref!r:.80}")


def _file_path(text: str, base_dir: Path | None) -> Path:
    if text.startswith("file://"):
        return Path(unquote(urlparse(text).path))
    if "://" in text:
        raise ImageError(
            f"image {_describe(text)}: only local paths, file:// and data: URLs are read "
            "(download remote images first)"
        )
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


def _file_bytes(path: Path, name: str) -> bytes:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ImageError(f"image {name}: cannot read {path} ({exc.strerror or exc})") from None
    if size > MAX_IMAGE_BYTES:
        raise ImageError(f"image {name}: {size} bytes is over the {MAX_IMAGE_BYTES} byte limit")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"image {name}: cannot read {path} ({exc.strerror or exc})") from None


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ImageError(
            f"image {_describe(url)}: a data URL must look like data:image/<type>;base64,<data>"
        )
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ImageError(f"image {_describe(url)}: over the {MAX_IMAGE_BYTES} byte limit")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"image {_describe(url)}: the base64 data is invalid") from None


def _checked_size(data: bytes, name: str) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"image {name}: over the {MAX_IMAGE_BYTES} byte limit")
    return data


def _check_pixels(image: Image.Image, name: str) -> None:
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"image {name}: {image.width}x{image.height} pixels is over the limit of "
            f"{MAX_IMAGE_PIXELS} pixels (8192x8192)"
        )


def _decode(data: bytes, name: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only: size before pixels
        _check_pixels(image, name)
        image.load()
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"image {name}: not an image PIL can decode ({exc})") from None
    return image.convert("RGB")
