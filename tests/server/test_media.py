"""The server's image inputs without a model (``tripod/server/media``): inline bytes, decoding with
its limits, fetching from a local host (allowed and refused hosts, redirects, sizes, a fetch that
never ends), a request's images loaded together in order. Every refusal is an ``ImageError`` (a
400) naming the request's part and saying what to change."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.support.media_host import MediaHost, data_url, encoded, picture
from tripod.config import ServerConfig
from tripod.server.media import decode as decode_mod
from tripod.server.media.decode import decode_image
from tripod.server.media.fetch import MediaFetcher, host_allowed
from tripod.server.media.loader import ImageLoader
from tripod.server.media.sources import ImageError, ImageRef, check_url, inline_bytes

PNG = encoded(picture(1))
B64 = base64.b64encode(PNG).decode()


def refused(e: pytest.ExceptionInfo[ImageError], code: str, param: str, *words: str) -> None:
    assert e.value.status == 400 and e.value.code == code and e.value.param == param, e.value.body()
    for w in words:
        assert w in e.value.message, (w, e.value.message)


# ---------------------------------------------------------------------- inline bytes
@pytest.mark.parametrize("url", [
    data_url(PNG), data_url(PNG, mime="application/octet-stream"),  # the MIME type is not trusted
    "data:image/png;base64," + "\n".join(B64[i:i + 76] for i in range(0, len(B64), 76)),
])
def test_inline_bytes_come_back_exactly(url: str) -> None:
    assert inline_bytes(ImageRef("p", url=url), 10**6) == PNG


def test_base64_and_percent_encoded_sources() -> None:
    assert inline_bytes(ImageRef("p", b64=base64.b64encode(PNG).decode()), 10**6) == PNG
    assert inline_bytes(ImageRef("p", url="data:image/png,%89PNG%0D%0A"), 100) == b"\x89PNG\r\n"


@pytest.mark.parametrize("ref, code, words", [
    (ImageRef("m.0", url="data:image/png;base64,@@@@"), "invalid_image", ("not valid base64",)),
    (ImageRef("m.0", url="data:image/png;base64"), "invalid_image_url", ("no ','",)),
    (ImageRef("m.0", b64="A" * 4000), "image_too_large", ("--max-image-bytes", "1000")),
    (ImageRef("m.0", url="data:image/png," + "a" * 1001), "image_too_large", ("1001 bytes",)),
])
def test_bad_inline_images_are_refused(ref: ImageRef, code: str, words: tuple[str, ...]) -> None:
    with pytest.raises(ImageError) as e:
        inline_bytes(ref, 1000)
    refused(e, code, "m.0", *words)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/y.png", "gopher://x", "/relative.png", "x"])
def test_only_data_and_http_urls_are_taken(url: str) -> None:
    with pytest.raises(ImageError) as e:
        check_url(url, "m.0.url")
    refused(e, "invalid_image_url", "m.0.url", "data: URL")


# ---------------------------------------------------------------------- decoding
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_every_format_is_sniffed_and_made_rgb(fmt: str) -> None:
    img = decode_image(encoded(picture(2, (24, 16)), fmt), "p", 10**6)
    assert img.mode == "RGB" and img.size == (24, 16)


def test_pixels_survive_decoding_and_transparency_goes_onto_white() -> None:
    src = picture(3, (8, 8))
    assert np.array_equal(np.asarray(decode_image(encoded(src), "p", 100)), np.asarray(src))
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent: white, as transformers makes it
    assert np.asarray(decode_image(encoded(rgba), "p", 100)).tolist() == [[[255, 255, 255]] * 4] * 4
    gray = decode_image(encoded(picture(4, (5, 5), "L")), "p", 100)
    assert gray.mode == "RGB"


@pytest.mark.parametrize("data, words", [
    (b"<html>hello</html>", ("not an image", "PNG, JPEG")),
    (b"", ("not an image",)),
    (b"%PDF-1.7\n" + b"x" * 100, ("not an image",)),
    (encoded(picture(5), "TIFF"), ("not an image",)),  # a real image, in a format not taken
])
def test_what_is_not_an_image_is_refused(data: bytes, words: tuple[str, ...]) -> None:
    with pytest.raises(ImageError) as e:
        decode_image(data, "m.0.url", 10**6)
    refused(e, "invalid_image", "m.0.url", *words)


def test_a_truncated_image_is_refused() -> None:
    jpeg = encoded(picture(6, (64, 64)), "JPEG")
    with pytest.raises(ImageError) as e:
        decode_image(jpeg[: len(jpeg) // 2], "p", 10**6)
    refused(e, "invalid_image", "p", "could not be decoded", "JPEG")


def test_a_decompression_bomb_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20000x20000 PNG of zeros is ~1 MB on the wire and 1.2 GB decoded: its header alone refuses it."""
    from PIL import ImageFile

    bomb = encoded(Image.new("1", (20000, 20000)))
    assert len(bomb) < 2 * 2**20
    loads: list[int] = []
    real_load = ImageFile.ImageFile.load

    def counting_load(self: ImageFile.ImageFile) -> Any:
        loads.append(1)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    with pytest.raises(ImageError) as e:
        decode_image(bomb, "p", 40_000_000)
    refused(e, "image_too_large", "p", "20000x20000", "--max-image-pixels")
    assert not loads
    small = encoded(picture(7, (10, 10)))
    with pytest.raises(ImageError):
        decode_image(small, "p", 99)
    assert decode_image(small, "p", 100).size == (10, 10)


# ---------------------------------------------------------------------- fetching
@pytest.fixture(scope="module")
def host() -> Iterator[MediaHost]:
    h = MediaHost({"/a.png": PNG, "/b.jpg": encoded(picture(8), "JPEG")}, big=300_000)
    yield h
    h.stop()


def fetch(url: str, hosts: tuple[str, ...] = ("127.0.0.1",), max_bytes: int = 100_000, timeout: float = 5.0) -> bytes:
    async def go() -> bytes:
        f = MediaFetcher(hosts, max_bytes, timeout)
        try:
            return await f.fetch(url, "m.0.url")
        finally:
            await f.close()

    return asyncio.run(go())


def test_allow_list_entries() -> None:
    from tripod.config_services import media_domains

    assert media_domains(" Img.Example.COM ,*.cdn.example,[::1], 10.0.0.7") == (
        "img.example.com", "*.cdn.example", "::1", "10.0.0.7")
    for bad in ("http://x", "x:80", "x/y", "*.", ".x", "[zz]", "a*b"):
        with pytest.raises(ValueError):
            media_domains(bad)


def test_an_allowed_host_is_fetched_and_redirects_within_it_followed(host: MediaHost) -> None:
    assert fetch(host.url("/a.png")) == PNG
    assert fetch(host.url("/relative/a.png")) == PNG
    assert fetch(host.url("/redirect/127.0.0.1/a.png")) == PNG


@pytest.mark.parametrize("path, host_name, hosts, code, words", [
    ("/a.png", "localhost", ("127.0.0.1",), "image_url_not_allowed", ("'localhost'", "--allowed-media-domains 127.0.0.1")),
    ("/a.png", "127.0.0.1", (), "image_url_not_allowed", ("without --allowed-media-domains", "data: URL")),
    ("/redirect/localhost/a.png", "127.0.0.1", ("127.0.0.1",), "image_url_not_allowed", ("'localhost'", "redirected")),
    ("/loop", "127.0.0.1", ("127.0.0.1",), "image_fetch_failed", ("redirects more than",)),
    ("/missing.png", "127.0.0.1", ("127.0.0.1",), "image_fetch_failed", ("HTTP 404",)),
    ("/big-declared", "127.0.0.1", ("127.0.0.1",), "image_too_large", ("300000 bytes", "--max-image-bytes")),
    ("/big-streamed", "127.0.0.1", ("127.0.0.1",), "image_too_large", ("--max-image-bytes",)),
])
def test_fetches_that_are_refused(host: MediaHost, path: str, host_name: str, hosts: tuple[str, ...], code: str,
                                  words: tuple[str, ...]) -> None:
    before = len(host.hits)
    with pytest.raises(ImageError) as e:
        fetch(host.url(path, host=host_name), hosts)
    refused(e, code, "m.0.url", *words)
    if code == "image_url_not_allowed" and "redirect" not in path:
        assert len(host.hits) == before  # a refused host is never contacted


def test_a_fetch_that_never_ends_is_cut_by_its_time_limit(host: MediaHost) -> None:
    with pytest.raises(ImageError) as e:
        fetch(host.url("/hang"), timeout=0.5)
    refused(e, "image_fetch_failed", "m.0.url", "longer than 0.5 s", "--media-fetch-timeout")


def test_an_unreachable_host_is_a_400() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        with pytest.raises(ImageError) as e:
            fetch(f"http://127.0.0.1:{s.getsockname()[1]}/x.png")
    finally:
        s.close()
    refused(e, "image_fetch_failed", "m.0.url", "ConnectError")


@pytest.mark.parametrize("name, patterns, ok", [
    ("img.example.com", ("img.example.com",), True),
    ("a.img.example.com", ("*.example.com",), True),
    ("example.com", ("*.example.com",), False),  # the wildcard is for subdomains only
    ("badexample.com", ("*.example.com",), False),
    ("img.example.com.evil.org", ("img.example.com",), False),
    ("127.0.0.1", ("127.0.0.1",), True),
    ("127.0.0.1", (), False),
    ("::1", ("::1",), True),
])
def test_host_patterns(name: str, patterns: tuple[str, ...], ok: bool) -> None:
    assert host_allowed(name, patterns) is ok


# ---------------------------------------------------------------------- a request's images together
def loader(**kw: Any) -> ImageLoader:
    return ImageLoader(replace(ServerConfig(), **{"allowed_media_domains": "127.0.0.1", **kw}))


def test_a_requests_images_come_back_in_order_from_every_source(host: MediaHost) -> None:
    pics = [picture(10 + i, (8 + i, 8)) for i in range(3)]
    refs = [ImageRef("m.0", url=data_url(pics[0])), ImageRef("m.1", url=host.url("/a.png")),
            ImageRef("m.2", b64=base64.b64encode(encoded(pics[2])).decode()), ImageRef("m.3", url=host.url("/b.jpg"))]
    out = asyncio.run(loader().load(refs))
    assert [o.size for o in out] == [(8, 8), (32, 32), (10, 8), (32, 32)]
    assert np.array_equal(np.asarray(out[2]), np.asarray(pics[2]))


def test_too_many_images_and_disallowed_urls_are_refused_before_any_fetch(host: MediaHost) -> None:
    before = len(host.hits)
    refs = [ImageRef(f"m.{i}", url=host.url("/a.png")) for i in range(3)]
    with pytest.raises(ImageError) as e:
        asyncio.run(loader(limit_mm_per_prompt=2).load(refs))
    refused(e, "too_many_images", "m.2", "3 images", "at most 2", "--limit-mm-per-prompt")
    refs[2] = ImageRef("m.2", url=host.url("/a.png", host="localhost"))
    with pytest.raises(ImageError) as e:
        asyncio.run(loader().load(refs))
    refused(e, "image_url_not_allowed", "m.2")
    assert len(host.hits) == before


def test_the_first_failure_fails_the_request_and_stops_the_rest(host: MediaHost) -> None:
    refs = [ImageRef("m.0", url=host.url("/hang")), ImageRef("m.1", url="data:image/png;base64,AAAA")]
    with pytest.raises(ImageError) as e:  # the bad inline image fails at once; the hanging fetch is cancelled
        asyncio.run(loader(media_fetch_timeout=60.0).load(refs))
    refused(e, "invalid_image", "m.1")


def test_decoding_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While an image decodes, the event loop goes on serving: a decode held on an event is seen
    to have started, other work on the loop completes, and only then is the decode let go."""
    started, go = threading.Event(), threading.Event()
    real = decode_mod.decode_image

    def held(data: bytes, param: str, max_pixels: int) -> Image.Image:
        started.set()
        assert go.wait(10), "the decode blocked the event loop (the test could not let it go)"
        return real(data, param, max_pixels)

    monkeypatch.setattr("tripod.server.media.loader.decode_image", held)

    async def scenario() -> list[str]:
        events: list[str] = []
        task = asyncio.ensure_future(loader().load([ImageRef("m.0", url=data_url(PNG))]))
        while not started.is_set():  # the loop is free to poll: the decode is in another thread
            await asyncio.sleep(0.01)
        events.append("loop ran while decoding")
        go.set()
        out = await task
        events.append(f"decoded {out[0].size}")
        return events

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == ["loop ran while decoding", "decoded (32, 32)"]
