"""The multi-model router (``tripod.fleet.multi``) over real HTTP: two stub OpenAI servers, one per
model, behind ``build_multi_router_app``, all uvicorn servers on 127.0.0.1 in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tripod.config import RouterConfig
from tripod.fleet.multi import MultiRouter, build_multi_router_app
from tripod.fleet.process import free_port
from tripod.router.router import Router


def stub(model: str, seen: list[dict[str, Any]]) -> Starlette:
    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        seen.append(body)
        if body.get("stream"):
            async def gen() -> AsyncIterator[bytes]:
                for piece in ("a", "b"):
                    yield f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse({"model": model, "choices": [{"message": {"content": f"from {model}"}}],
                             "usage": {"prompt_tokens": 3}})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 99}]})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


async def _serve(app: Any, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="on"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "a test server failed to start"
        await asyncio.sleep(0.01)  # NOTE: uvicorn announces its start only through this flag
    server.__dict__["task"] = task
    return server


def test_requests_go_to_the_fleet_of_their_model() -> None:
    async def main() -> None:
        seen: dict[str, list[dict[str, Any]]] = {"writer": [], "judge": []}
        ports = {m: free_port() for m in seen}
        stubs = [await _serve(stub(m, seen[m]), ports[m]) for m in seen]
        multi = MultiRouter()
        for m, port in ports.items():
            r = Router(RouterConfig(health_interval=0.2))
            r.add_replica("replica-0", f"http://127.0.0.1:{port}")
            multi.add(m, r)

        @contextlib.asynccontextmanager
        async def lifespan(_: Any) -> AsyncIterator[None]:
            await multi.start()
            assert await multi.wait_routable(10) is None
            yield
            await multi.stop()

        port = free_port()
        front = await _serve(build_multi_router_app(multi, lifespan), port)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                r = await c.post("/v1/chat/completions", json={"model": "judge", "messages": []})
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "from judge"
                assert r.headers["x-tripod-replica"] == "replica-0"
                r = await c.post("/v1/chat/completions", json={"model": "writer", "messages": [], "stream": True})
                assert r.status_code == 200 and r.text.count("data:") == 3
                assert [len(v) for v in seen.values()] == [1, 1]
                r = await c.post("/v1/chat/completions", json={"model": "nope", "messages": []})
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
                assert "'writer', 'judge'" in r.json()["error"]["message"]
                r = await c.post("/v1/chat/completions", json={"messages": []})  # two models: must name one
                assert r.status_code == 404
                models = (await c.get("/v1/models")).json()["data"]
                assert [(m["id"], m["ready"], m["max_model_len"]) for m in models] == [
                    ("writer", True, 99), ("judge", True, 99)]
                assert (await c.get("/v1/models/judge")).json()["id"] == "judge"
                assert (await c.get("/v1/models/nope")).status_code == 404
                assert (await c.get("/health")).json()["models"] == {"writer": 1, "judge": 1}
                page = (await c.get("/metrics")).text
                assert 'model="judge"' in page and 'model="writer"' in page
                fleet = (await c.get("/fleet")).json()["models"]
                assert fleet["judge"]["replicas"][0]["routed"] == 1 and fleet["writer"]["source"] == "fleet"
        finally:
            for s in (front, *stubs):
                s.should_exit = True
                await s.__dict__["task"]

    asyncio.run(main())
