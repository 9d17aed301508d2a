"""Where a request's image comes from, as the client said it: ``ImageRef`` (a ``data:`` URL, an
``http(s)`` URL, or base64 with a media type), and the errors an image can cause (``ImageError``:
a 400 that names the part of the request and what to change).

Nothing here fetches or decodes: the API surfaces make ``ImageRef``s while they check a request's
shape, and ``loader.ImageLoader`` turns them into pictures once the whole request is known to be
well formed (so a malformed request never costs a fetch).
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from dataclasses import dataclass

from tripod.server.errors import APIError

DETAILS = ("auto", "low", "high")  # OpenAI's image detail levels (the processor decides what each means)


class ImageError(APIError):
    """A 400 about one image of a request: ``param`` names where it is, the message what to change."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image of a request, not loaded yet: a URL (``data:`` or ``http(s)``) or base64 bytes.

    ``param`` is where the request holds it (errors name it); ``detail`` is OpenAI's ``detail``
    (None: not given), handed to the processor."""

    param: str
    url: str | None = None
    b64: str | None = None  # Anthropic's base64 source (its media_type is not trusted: the bytes are sniffed)
    detail: str | None = None

    def __post_init__(self) -> None:
        assert (self.url is None) != (self.b64 is None), "an image is a URL or base64 data"

    @property
    def inline(self) -> bool:
        """Whether the bytes are in the request (``data:`` URL or base64), not behind a URL."""
        return self.b64 is not None or (self.url is not None and self.url[:5].lower() == "data:")

    @property
    def source(self) -> str:
        """``inline`` or ``url`` (the metrics' label)."""
        return "inline" if self.inline else "url"


def check_detail(detail: object, param: str) -> str | None:
    if detail is None or detail in DETAILS:
        return detail  # type: ignore[return-value]
    raise ImageError(f"'{param}' must be one of {', '.join(DETAILS)} (got {detail!r})", param, "invalid_image_detail")


def check_url(url: str, param: str) -> str:
    """A URL an image may come from: ``data:`` or ``http(s)``; anything else is refused by name."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("data", "http", "https"):
        return url
    raise ImageError(f"'{param}' must be a data: URL (data:image/png;base64,...) or an http(s) URL "
                     f"(got {_shown(url)})", param, "invalid_image_url")


def inline_bytes(ref: ImageRef, max_bytes: int) -> bytes:
    """The bytes of an inline image (base64, or a ``data:`` URL: base64 or percent-encoded),
    refused past ``max_bytes`` before they are decoded."""
    if ref.b64 is not None:
        return _b64(ref.b64, ref.param, max_bytes)
    assert ref.url is not None
    head, sep, payload = ref.url.partition(",")
    if not sep:
        raise ImageError(f"'{ref.param}' is not a data: URL (no ','); send data:image/png;base64,<data>",
                         ref.param, "invalid_image_url")
    if head.lower().endswith(";base64"):
        return _b64(payload, ref.param, max_bytes)
    if len(payload) > 3 * max_bytes:  # (each byte takes 1 to 3 characters percent-encoded)
        raise too_large(ref.param, len(payload), max_bytes)
    data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise too_large(ref.param, len(data), max_bytes)
    return data


def _b64(text: str, param: str, max_bytes: int) -> bytes:
    if len(text) // 4 * 3 > max_bytes + 3:  # (a cheap bound first: no decoding of what is too large anyway)
        raise too_large(param, len(text) // 4 * 3, max_bytes)
    if any(c in text for c in " \n\r\t"):  # MIME base64 breaks lines; nothing else is tolerated
        text = "".join(text.split())
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"'{param}' is not valid base64; send the image's bytes base64-encoded", param,
                         "invalid_image") from None
    if len(data) > max_bytes:
        raise too_large(param, len(data), max_bytes)
    return data


def too_large(param: str, size: int, max_bytes: int) -> ImageError:
    return ImageError(f"'{param}': the image is {size} bytes, more than this server takes ({max_bytes}, "
                      "--max-image-bytes); send a smaller image (fewer pixels, or JPEG)", param, "image_too_large")


def _shown(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")
