"""The console's HTTP routes, mounted by the server (``tripod serve``) and the router (``tripod
route``, a fleet) on their own app:

- ``GET /ui`` (and ``/ui/``): the page; ``GET /ui/static/<file>``: its scripts and styles. These hold
  no data and are served without a key, so a browser can load the page and then ask for the key.
- ``GET /ui/api/info | fleet | series?since=T | bench | tenants``: the JSON the page reads (models.py;
  ``tenants``: per tenant, from the source's ``tenant_families()`` when it has them). When
  the process has an API key they need it, like the API itself: ``Authorization: Bearer KEY`` (or
  ``x-api-key``). The page asks for the key once, keeps it in the tab's ``sessionStorage`` and
  sends it as a Bearer header on every call (its playground too).

The console imports neither the server nor the router: each gives it a ``ConsoleSource``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tripod.console.bench_runs import bench_index
from tripod.console.models import ConsoleInfo, Series
from tripod.console.sampler import ConsoleSource, SeriesSampler
from tripod.console.tenants import tenant_views

OPEN_PREFIX = "/ui/static/"
_MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}


def is_open_path(path: str) -> bool:
    """The page shell (no data): served without an API key."""
    return path in ("/ui", "/ui/") or path.startswith(OPEN_PREFIX)


def _static_files() -> dict[str, bytes]:
    root = resources.files("tripod.console") / "static"
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file() and not f.name.startswith(".")}


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers={"Cache-Control": "no-store"})


def _version() -> str:
    from tripod import __version__

    return __version__


class Console:
    """Owns the sampler and the page's routes for one server or router."""

    def __init__(self, source: ConsoleSource, *, api_key: str | None = None, bench_dir: str | None = None,
                 interval: float = 1.0, window: float = 5.0, history: float = 600.0) -> None:
        self.source = source
        self.sampler = SeriesSampler(source, interval=interval, window=window, history=history)
        self.bench_dir = bench_dir
        self._key = api_key.encode() if api_key else None
        self._static = _static_files()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.sampler.start()

    async def stop(self) -> None:
        await self.sampler.stop()

    def wrap_lifespan(self, lifespan: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        """The app's lifespan with the sampler running inside it (started once the app's own
        start-up is done, stopped before its shutdown)."""

        @contextlib.asynccontextmanager
        async def combined(app: Any) -> AsyncIterator[None]:
            async with contextlib.AsyncExitStack() as stack:
                if lifespan is not None:
                    await stack.enter_async_context(lifespan(app))
                await self.start()
                try:
                    yield
                finally:
                    await self.stop()

        return combined

    # ------------------------------------------------------------ auth
    def authorized(self, request: Request) -> bool:
        if self._key is None:
            return True
        bearer = request.headers.get("authorization", "").encode()
        x_key = request.headers.get("x-api-key", "").encode()
        # NOTE: both comparisons always made, in constant time (as the server's own guard).
        ok_bearer = hmac.compare_digest(bearer, b"Bearer " + self._key)
        ok_x = hmac.compare_digest(x_key, self._key)
        return ok_bearer or ok_x

    def _guarded(self, fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            if not self.authorized(request):
                given = bool(request.headers.get("authorization") or request.headers.get("x-api-key"))
                why = "the API key is not valid" if given else "no API key was given"
                return _error(401, f"{why}; send 'Authorization: Bearer <key>' (the page asks for it)",
                              "invalid_api_key")
            return await fn(request)
        return handler

    # ------------------------------------------------------------ routes
    def routes(self) -> list[Route]:
        g = self._guarded
        return [
            Route("/ui", self._index, methods=["GET"]),
            Route("/ui/", self._index, methods=["GET"]),
            Route("/ui/static/{name}", self._file, methods=["GET"]),
            Route("/ui/api/info", g(self._info), methods=["GET"]),
            Route("/ui/api/fleet", g(self._fleet), methods=["GET"]),
            Route("/ui/api/series", g(self._series), methods=["GET"]),
            Route("/ui/api/bench", g(self._bench), methods=["GET"]),
            Route("/ui/api/tenants", g(self._tenants), methods=["GET"]),
            Route("/ui/api/{rest:path}", g(self._unknown), methods=["GET", "POST"]),
        ]

    async def _index(self, _: Request) -> Response:
        return Response(self._static["index.html"], media_type=_MEDIA[".html"], headers={"Cache-Control": "no-cache"})

    async def _file(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = self._static.get(name)
        if body is None:
            return _error(404, f"no console file {name!r}", "not_found")
        ext = name[name.rfind("."):] if "." in name else ""
        return Response(body, media_type=_MEDIA.get(ext, "application/octet-stream"),
                        headers={"Cache-Control": "no-cache"})

    async def _info(self, _: Request) -> Response:
        s = self.sampler
        return _json(ConsoleInfo(kind=self.source.kind, model=self.source.model(), version=_version(),
                                 interval_s=s.interval, window_s=s.window, history_s=s.history,
                                 bench_dir=self.bench_dir, auth=self._key is not None))

    async def _fleet(self, _: Request) -> Response:
        view = await self.source.fleet()
        view.events = sorted([*view.events, *self.sampler.events], key=lambda e: e.t)
        return _json(view)

    async def _series(self, request: Request) -> Response:
        raw = request.query_params.get("since")
        since = None
        if raw not in (None, ""):
            try:
                since = float(raw)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                return _error(400, f"'since' must be a Unix time in seconds (got {raw!r})", "invalid_since")
        s = self.sampler
        return _json(Series(interval_s=s.interval, window_s=s.window, points=s.since(since)))

    async def _bench(self, _: Request) -> Response:
        # Reading the folder is file IO: off the event loop, which serves streams.
        return _json(await asyncio.to_thread(bench_index, self.bench_dir))

    async def _tenants(self, _: Request) -> Response:
        families = getattr(self.source, "tenant_families", None)
        source: Literal["server", "router"] = "server" if self.source.kind == "server" else "router"
        return _json(tenant_views(families() if families is not None else [], source))

    async def _unknown(self, request: Request) -> Response:
        return _error(404, f"no console API route {request.url.path}; see /ui/api/info, /ui/api/fleet, "
                      "/ui/api/series, /ui/api/bench, /ui/api/tenants", "not_found")
