"""Test images and a local image host (127.0.0.1) for the server's image fetching: served images,
redirects that stay on the host or leave for another name, an oversized body (declared, or
streamed without a length), a 404, a body that is not an image, and one that never finishes (held
until the host stops: a fetch's time limit is what ends it, never a sleep)."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from PIL import Image


def picture(seed: int, size: tuple[int, int] = (32, 32), mode: str = "RGB") -> Image.Image:
    """A random image of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def data_url(img: Image.Image | bytes, fmt: str = "PNG", mime: str | None = None) -> str:
    raw = img if isinstance(img, bytes) else encoded(img, fmt)
    return f"data:{mime or 'image/' + fmt.lower()};base64,{base64.b64encode(raw).decode()}"


class MediaHost:
    """A threaded HTTP server on 127.0.0.1 serving ``routes`` (path → bytes) and the special paths
    of the module docstring. ``url(path)`` names it by address, ``url(path, host="localhost")`` by
    another name (the same server, a host an allow-list of "127.0.0.1" does not list)."""

    def __init__(self, routes: dict[str, bytes] | None = None, big: int = 1 << 20) -> None:
        self.routes = dict(routes or {})
        self.big = big
        self.release = threading.Event()
        self.hits: list[str] = []
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_GET(self) -> None:
                host.hits.append(self.path)
                action: Callable[[BaseHTTPRequestHandler], None] | None = host.special(self.path)
                if action is not None:
                    action(self)
                elif self.path in host.routes:
                    self._send(200, host.routes[self.path], "image/png")
                else:
                    self._send(404, b"no such image", "text/plain")

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def special(self, path: str) -> Callable[[BaseHTTPRequestHandler], None] | None:
        if path.startswith("/redirect/"):  # /redirect/<host>/<path>: a 302 to that host's path here
            _, _, name, rest = path.split("/", 3)
            return lambda h: self._redirect(h, self.url("/" + rest, host=name))
        if path.startswith("/relative/"):  # a 302 with a relative Location
            return lambda h: self._redirect(h, "/" + path.split("/", 2)[2])
        if path == "/loop":
            return lambda h: self._redirect(h, "/loop")
        return {"/big-declared": self._big_declared, "/big-streamed": self._big_streamed, "/hang": self._hang,
                "/text": self._text}.get(path)

    @staticmethod
    def _redirect(h: BaseHTTPRequestHandler, location: str) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _big_declared(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(self.big))
        h.end_headers()  # (nothing sent: a client that reads the body would wait for it)

    def _big_streamed(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Connection", "close")  # no length: the body ends when the connection does
        h.end_headers()
        chunk = b"\0" * 65536
        try:
            for _ in range(self.big // len(chunk) + 2):
                h.wfile.write(chunk)
        except OSError:
            pass  # the client stopped reading (as it should)

    def _hang(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b"\x89PNG")
        h.wfile.flush()
        self.release.wait(60)  # until the host stops: only the client's time limit ends the fetch

    @staticmethod
    def _text(h: BaseHTTPRequestHandler) -> None:
        body = b"<html>not an image</html>"
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
