"""Image bytes → an RGB picture, with the limits a server facing the internet needs.

The format is sniffed from the bytes by PIL (a client's MIME type or file name is never trusted),
among the formats vision models are sent (PNG, JPEG, WebP, GIF: its first frame, BMP); the size
in pixels is read from the header and refused past ``--max-image-pixels`` before anything is
decoded (a decompression bomb costs a header read). Runs in a worker thread (``loader``): decoding
a large JPEG takes tens of milliseconds, which the event loop must not spend.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from tripod.loader.multimodal import to_rgb
from tripod.server.media.sources import ImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# NOTE: PIL's own decompression-bomb check (a process-wide limit, with no size in its error) is
# replaced by the server's: --max-image-pixels, checked on the header before anything is decoded.
Image.MAX_IMAGE_PIXELS = None


def decode_image(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """``data`` as an RGB ``PIL.Image`` (loaded), or an ``ImageError`` saying what to send instead."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise ImageError(f"'{param}' is not an image tripod can read: send PNG, JPEG, WebP, GIF or BMP bytes "
                         f"({len(data)} bytes starting {data[:8]!r} were sent)", param, "invalid_image") from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > max_pixels:
        img.close()
        raise _too_many_pixels(param, (width, height), max_pixels)
    try:
        img.load()
        return to_rgb(img)
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageError(f"'{param}': the {img.format} image could not be decoded ({e}); send a complete, "
                         "uncorrupted image", param, "invalid_image") from None


def _too_many_pixels(param: str, size: tuple[int, int], max_pixels: int) -> ImageError:
    return ImageError(f"'{param}': the image is {size[0]}x{size[1]} pixels; this server takes at most {max_pixels} pixels "
                      "(--max-image-pixels); send a smaller image", param, "image_too_large")
