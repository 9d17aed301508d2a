"""LoRA adapter management through a router: a load or unload goes to every routable replica
(each serves the adapters of its own engine), and the answer says how each one answered.

Adapters named by ``--lora`` at start are loaded by every replica a fleet launches (restarted ones
included); one loaded live through the router reaches the replicas routable at that moment."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from tripod.router.errors import RouterError
from tripod.router.router import Router

LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_SENT_HEADERS = ("authorization", "x-api-key", "content-type")
TIMEOUT_S = 660.0  # an unload waits for the adapter's running requests (the replica's own limit is 600 s)


async def broadcast(router: Router, path: str, raw: bytes, headers: dict[str, str]) -> Response:
    replicas = router.routable()
    if not replicas:
        raise RouterError(503, "no replica is routable: nothing to load the adapter into; retry when one is up",
                          "no_replica")
    send = {k: v for k, v in headers.items() if k.lower() in _SENT_HEADERS}
    assert router.client is not None

    async def one(url: str) -> tuple[int, Any]:
        try:
            r = await router.client.post(url + path, content=raw, headers=send, timeout=TIMEOUT_S)
        except httpx.HTTPError as e:
            return 502, {"error": {"message": f"{type(e).__name__}: {e}"}}
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text[:500]}}

    answers = await asyncio.gather(*(one(rep.url) for rep in replicas))
    by_name = {rep.name: {"status": code, "body": body} for rep, (code, body) in zip(replicas, answers, strict=True)}
    failed = {n: a for n, a in by_name.items() if a["status"] != 200}
    if not failed:
        first = answers[0][1]
        return JSONResponse({**first, "replicas": by_name})
    status = max(a["status"] for a in failed.values())  # (a client error everywhere stays a 4xx)
    why = "; ".join(f"{n}: {_message(a['body'])}" for n, a in failed.items())
    return JSONResponse({"error": {"message": f"{len(failed)} of {len(by_name)} replicas refused: {why}",
                                   "type": "invalid_request_error" if status < 500 else "server_error",
                                   "param": None, "code": None},
                         "replicas": by_name}, status_code=status)


def _message(body: Any) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("message") if isinstance(err, dict) else body)
