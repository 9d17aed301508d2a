"""Stored responses behind the router: ``GET``/``DELETE /v1/responses/{id}`` (and
``.../input_items``), ``POST /v1/responses/{id}/cancel``.

The router does not know which replica stored a response (nor ran a background one), so it asks
the routable replicas in turn and answers with the first reply that is not a 404 (or the last
404). Replicas sharing one sqlite store (``--responses-store sqlite:PATH``) all find it, and the
first answers; with memory stores the replica that answered finds it. A background run lives in
the replica that started it: the others answer its cancel with a 404 (``response_running_elsewhere``),
so the fan-out reaches it. Bodies are small and read whole (a replayed stream is read to its end).
"""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import Response

from tripod.router.errors import RouterError
from tripod.router.router import Router

_PASS = ("content-type", "x-request-id")


async def find_stored(router: Router, request: Request, headers: dict[str, str]) -> Response:
    """The first non-404 answer of the routable replicas to this request."""
    assert router.client is not None
    reps = router.routable()
    if not reps:
        raise RouterError(503, "no replica is routable; retry shortly", "no_replica", router.config.retry_after)
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    body = await request.body()
    last: Response | None = None
    for rep in reps:
        try:
            r = await router.client.request(request.method, rep.url + path, content=body or None, headers=headers)
        except httpx.HTTPError as e:  # a replica that cannot answer: ask the next
            last = RouterError(502, f"{rep.name} could not be asked: {type(e).__name__}", "replica_failed").response()
            continue
        out = Response(r.content, status_code=r.status_code,
                       headers={k: v for k, v in r.headers.items() if k.lower() in _PASS} | {"x-tripod-replica": rep.name})
        if r.status_code != 404:
            return out
        last = out
    assert last is not None
    return last
