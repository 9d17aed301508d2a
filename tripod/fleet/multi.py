"""One router in front of fleets of several models: each request goes to the fleet of the model it
names (its ``model`` field), and ``/v1/models`` lists every model.

Each model has its own ``Router`` (and, when this process launches its replicas, its own
``Supervisor``): routing policy, health, retries, restarts and autoscaling are per model, exactly
as for one model (``tripod serve --replicas``). A model may also be an endpoint that runs already
(a ``Router`` with that one replica). A request without ``model`` goes to the only model when there
is one; a model that is not served is a 404 that lists those that are.

``tripod chains serve`` uses this for the models of a chain; ``build_multi_router_app`` serves it
on its own; ``multi_router_routes`` gives the routes to mount next to others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tripod.config_services import MAX_BODY_BYTES
from tripod.fleet.supervisor import Supervisor
from tripod.router.app import PROXIED_PATHS, forward_unless_gone, read_request
from tripod.router.errors import RouterError
from tripod.router.merge import merge_pages
from tripod.router.router import Router

log = logging.getLogger("tripod.router")


@dataclass(slots=True)
class ModelFleet:
    """One model: its router and, when its replicas are launched here, its supervisor."""

    name: str
    router: Router
    supervisor: Supervisor | None = None
    source: str = "fleet"  # fleet | url

    def info(self) -> dict[str, Any]:
        r = self.router
        out: dict[str, Any] = {"source": self.source, "policy": r.policy.name, "pending": r.pending,
                               "routable_replicas": len(r.routable()),
                               "replicas": [rep.describe() for rep in r.replicas.values()]}
        if self.supervisor is not None:
            out.update(self.supervisor.info())
        return out


class MultiRouter:
    def __init__(self) -> None:
        self.fleets: dict[str, ModelFleet] = {}
        self._draining = False

    def add(self, name: str, router: Router, supervisor: Supervisor | None = None, source: str = "fleet") -> None:
        if name in self.fleets:
            raise ValueError(f"the model {name!r} is served twice")
        self.fleets[name] = ModelFleet(name, router, supervisor, source)

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for f in self.fleets.values():
            f.router.draining = value

    def fleet_for(self, model: Any) -> ModelFleet:
        if model is None and len(self.fleets) == 1:
            return next(iter(self.fleets.values()))
        fleet = self.fleets.get(model) if isinstance(model, str) else None
        if fleet is None:
            served = ", ".join(repr(n) for n in self.fleets) or "none"
            what = "names no model" if model is None else f"names the model {model!r}, which is not served here"
            raise RouterError(404, f"the request {what}; the models served are {served}", "model_not_found")
        return fleet

    def ready(self) -> bool:
        return all(f.router.routable() for f in self.fleets.values())

    def not_ready(self) -> list[str]:
        return [n for n, f in self.fleets.items() if not f.router.routable()]

    async def start(self) -> None:
        for f in self.fleets.values():
            await f.router.start()
        await asyncio.gather(*(f.supervisor.start() for f in self.fleets.values() if f.supervisor is not None))

    async def wait_routable(self, timeout: float) -> str | None:
        """Wait until every model has a routable replica; None, or why not."""

        async def one(f: ModelFleet) -> str | None:
            if f.supervisor is not None:
                ok = await f.supervisor.wait_routable(timeout)
                return None if ok else (f.supervisor.fatal or f"no replica became healthy in {timeout:.0f} s")
            ok = await f.router.wait_until(lambda: bool(f.router.routable()), timeout)
            return None if ok else f"its endpoint did not answer /health in {timeout:.0f} s"

        whys = await asyncio.gather(*(one(f) for f in self.fleets.values()))
        bad = [f"model {n!r}: {w}" for n, w in zip(self.fleets, whys, strict=True) if w is not None]
        return "; ".join(bad) or None

    async def stop(self) -> None:
        await asyncio.gather(*(f.supervisor.stop() for f in self.fleets.values() if f.supervisor is not None),
                             return_exceptions=True)
        for f in self.fleets.values():
            await f.router.stop()

    async def cards(self, headers: dict[str, str]) -> list[dict[str, Any]]:
        """Every model's card: its replica's own (with dtype, context), or a stub while none is routable."""

        async def card(f: ModelFleet) -> dict[str, Any]:
            client = f.router.probe_client
            for rep in f.router.routable():
                if client is None:
                    break
                try:
                    r = await client.get(rep.url + "/v1/models", headers=headers)
                    data = r.json().get("data") or []
                except (httpx.HTTPError, ValueError, AttributeError):
                    continue
                if r.status_code == 200 and data:
                    mine = next((c for c in data if c.get("id") == f.name), data[0])
                    return {**mine, "id": f.name, "ready": True}
            return {"id": f.name, "object": "model", "owned_by": "tripod", "ready": False}

        return list(await asyncio.gather(*(card(f) for f in self.fleets.values())))

    def metrics_page(self) -> bytes:
        pages = []
        for name, f in self.fleets.items():
            r = f.router
            pages.append(({"model": name}, r.metrics.render(r.replicas.values(), r.queue_depth, r.pending).decode()))
        return merge_pages(pages)


def multi_router_routes(multi: MultiRouter) -> list[Route]:
    """The OpenAI routes (proxied by ``model``), ``/v1/models`` and ``/fleet``."""

    def counted(route: str, fn: Callable[[Request], Awaitable[tuple[Response, ModelFleet | None]]]) \
            -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            fleet = None
            try:
                resp, fleet = await fn(request)
            except RouterError as e:
                resp = e.response()
            if fleet is not None:
                fleet.router.metrics.http_requests.labels(route, str(resp.status_code)).inc()
            return resp
        return handler

    async def proxied(request: Request) -> tuple[Response, ModelFleet | None]:
        limit = min((f.router.config.max_body_bytes for f in multi.fleets.values()), default=MAX_BODY_BYTES)
        raw, body = await read_request(request, limit)
        fleet = multi.fleet_for(body.get("model"))
        return await forward_unless_gone(fleet.router, request, raw, body), fleet

    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        model_id = request.path_params.get("model_id")
        cards = await multi.cards(headers)
        if model_id is None:
            return JSONResponse({"object": "list", "data": cards})
        for c in cards:
            if c["id"] == model_id:
                return JSONResponse(c)
        multi.fleet_for(model_id)  # not served: its 404 lists the models that are
        raise RouterError(404, f"the model {model_id!r} is not served here", "model_not_found")

    async def models_handler(request: Request) -> Response:
        try:
            return await models(request)
        except RouterError as e:
            return e.response()

    async def fleet(_: Request) -> Response:
        return JSONResponse({"models": {n: f.info() for n, f in multi.fleets.items()}})

    routes = [Route(p, counted(p, proxied), methods=["POST"]) for p in PROXIED_PATHS]
    routes += [
        Route("/v1/models", models_handler, methods=["GET"]),
        Route("/v1/models/{model_id:path}", models_handler, methods=["GET"]),
        Route("/fleet", fleet, methods=["GET"]),
    ]
    return routes


def build_multi_router_app(multi: MultiRouter, lifespan: Any = None) -> Starlette:
    """The multi-model router on its own: the routes above, ``/health`` (200 while every model has
    a routable replica) and ``/metrics`` (every model's router metrics, labelled ``model``)."""

    async def health(_: Request) -> Response:
        missing = multi.not_ready()
        ok = not missing and not multi.draining
        status = "draining" if multi.draining else ("ok" if ok else "no routable replica for " + ", ".join(missing))
        return JSONResponse({"status": status, "models": {n: len(f.router.routable()) for n, f in
                                                          multi.fleets.items()}}, status_code=200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(multi.metrics_page(), media_type="text/plain; version=0.0.4")

    routes = [*multi_router_routes(multi), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)
