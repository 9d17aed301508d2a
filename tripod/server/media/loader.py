"""A request's images, from references to pictures: ``ImageLoader``.

Inline bytes are decoded from base64 and URLs fetched (``fetch.MediaFetcher``) concurrently,
then each image is decoded (``decode.decode_image``) in a worker thread, so that one large image
never holds up the event loop that serves every other request; at most ``decoders`` decode at
once (the work is CPU-bound: more threads than cores only add memory). Pictures come back in the
request's order. The first image that fails fails the request (a 400 naming it), and the others'
work is cancelled.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable

from PIL import Image

from tripod.config import ServerConfig
from tripod.server.media.decode import decode_image
from tripod.server.media.fetch import MediaFetcher
from tripod.server.media.sources import ImageError, ImageRef, inline_bytes


class ImageLoader:
    """Owns the rules every image of a request is loaded under (count, bytes, pixels, which URLs)
    and the fetcher; ``load`` turns a request's ``ImageRef``s into RGB pictures, in order."""

    def __init__(self, config: ServerConfig, decoders: int | None = None) -> None:
        self.max_images = config.limit_mm_per_prompt
        self.max_bytes = config.max_image_bytes
        self.max_pixels = config.max_image_pixels
        self.fetcher = MediaFetcher(config.media_hosts, config.max_image_bytes, config.media_fetch_timeout)
        self._decoders = asyncio.Semaphore(decoders or max(2, os.cpu_count() or 2))

    def check(self, refs: list[ImageRef]) -> None:
        """What can be refused before any byte is fetched or decoded: too many images, a URL that
        may not be fetched."""
        if len(refs) > self.max_images:
            extra = refs[self.max_images]
            raise ImageError(f"the request holds {len(refs)} images; this server takes at most {self.max_images} per "
                             f"request (--limit-mm-per-prompt); send fewer ('{extra.param}' is one too many)",
                             extra.param, "too_many_images")
        for r in refs:
            if not r.inline:
                assert r.url is not None
                self.fetcher.check(r.url, r.param)

    async def load(self, refs: list[ImageRef]) -> list[Image.Image]:
        """The pictures of ``refs``, in order; an ``ImageError`` for the first that fails."""
        self.check(refs)
        return await _all([self._one(r) for r in refs])

    async def _one(self, ref: ImageRef) -> Image.Image:
        if ref.inline:
            # (base64 of megabytes: off the loop too)
            data = await asyncio.to_thread(inline_bytes, ref, self.max_bytes)
        else:
            assert ref.url is not None
            data = await self.fetcher.fetch(ref.url, ref.param)
        async with self._decoders:
            return await asyncio.to_thread(decode_image, data, ref.param, self.max_pixels)

    async def close(self) -> None:
        await self.fetcher.close()


async def _all(jobs: list[Awaitable[Image.Image]]) -> list[Image.Image]:
    """Every job's result in order; on the first failure the others are cancelled (and awaited,
    so none is left running unobserved) and that failure is raised."""
    tasks = [asyncio.ensure_future(j) for j in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
