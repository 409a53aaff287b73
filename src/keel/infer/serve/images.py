"""Images in chat requests (OpenAI `image_url` content parts): which references the server
reads, within which limits; every refusal is a 400 naming the part and the reason.

Policy: `data:image/...;base64,` URLs always; file paths and `file://` URLs only from inside
the folder given as --image-root (symlinks resolved), never otherwise; http(s) URLs never
(the server does not download: it may have no network, and fetching client-given URLs from
the server's network is a hazard). Limits: images per request, bytes per image (before
decoding), pixels per image (--max-images, --max-image-size, --max-image-pixels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from keel.errors import ImageError
from keel.infer.serve.limits import ApiError
from keel.models.vision.images import load_image


@dataclass(frozen=True, kw_only=True)
class ImagePolicy:
    """Where request images may come from, and how big they may be."""

    root: Path | None = None  # file paths only inside this folder (resolved); None: none
    max_images: int = 4
    max_bytes: int = 8 << 20
    max_pixels: int = 4096 * 4096


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: where it sits (`param`, e.g. messages.0.content.1.
    image_url.url) and its URL."""

    param: str
    url: str


def load_request_images(refs: list[ImageRef], policy: ImagePolicy) -> list:
    """The requested images, decoded (RGB PIL images, in order); ApiError(400) for the
    first one the policy refuses or that does not decode."""
    if len(refs) > policy.max_images:
        raise ApiError(
            400,
            f"the request has {len(refs)} images; this server takes at most "
            f"{policy.max_images} per request (--max-images)",
            param="messages",
            code="too_many_images",
        )
    return [_load(ref, policy) for ref in refs]


def _load(ref: ImageRef, policy: ImagePolicy):
    url = ref.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        _check_bytes(ref, _data_url_bytes(url), policy)
        source = url
    elif scheme in ("http", "https"):
        raise _refused(
            ref,
            "keel serve does not download images; send the image inline as a "
            "data:image/<type>;base64,<data> URL",
            "image_url_not_supported",
        )
    elif scheme == "file" or "://" not in url:
        source = _file_in_root(ref, policy)
        _check_bytes(ref, source.stat().st_size, policy)
    else:
        raise _refused(
            ref, f"{scheme}: URLs are not read; send a data: URL", "image_url_not_supported"
        )
    try:
        image = load_image(source)
    except ImageError as e:
        raise _refused(ref, str(e), "invalid_image") from None
    pixels = image.width * image.height
    if pixels > policy.max_pixels:
        raise _refused(
            ref,
            f"the image is {image.width}x{image.height} = {pixels} pixels; this server takes "
            f"at most {policy.max_pixels} pixels per image (--max-image-pixels)",
            "image_too_large",
        )
    return image


def _file_in_root(ref: ImageRef, policy: ImagePolicy) -> Path:
    if policy.root is None:
        raise _refused(
            ref,
            "image paths are off on this server; send a data: URL, or start keel serve with "
            "--image-root DIR to allow image files from inside DIR",
            "image_path_not_allowed",
        )
    given = unquote(urlparse(ref.url).path) if ref.url.startswith("file:") else ref.url
    try:
        path = (policy.root / given).resolve()  # an absolute path replaces the root
    except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, symlink loops
        raise _refused(ref, f"not a usable path: {e}", "invalid_image") from None
    if not path.is_relative_to(policy.root):
        raise _refused(
            ref,
            f"the path leads outside the image root {policy.root}; only files inside "
            "--image-root are read",
            "image_path_not_allowed",
        )
    if not path.is_file():
        raise _refused(ref, "no such file inside the image root", "invalid_image")
    return path


def _data_url_bytes(url: str) -> int:
    # base64 carries 3 bytes in 4 characters: the size is known before decoding anything.
    payload = url.partition(",")[2]
    return len(payload) * 3 // 4


def _check_bytes(ref: ImageRef, size: int, policy: ImagePolicy) -> None:
    if size > policy.max_bytes:
        raise _refused(
            ref,
            f"the image is {size} bytes; this server takes at most {policy.max_bytes} bytes "
            "per image (--max-image-size)",
            "image_too_large",
        )


def _refused(ref: ImageRef, why: str, code: str) -> ApiError:
    return ApiError(400, f"{ref.param}: {why}", param=ref.param, code=code)
