"""The ASGI middleware that servers and routers share: who is calling, and the tenant's
bookkeeping after the answer's last byte (streams included: the wrapped app returns only then)."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tripod.tenants.gate import SCOPE_KEY, TenantGate
from tripod.tenants.limiter import OverLimit

# (path, message) → the app that answers 401 in the API's shape at that path.
Refusal = Callable[[str, str], ASGIApp]
# (path, the limit's refusal) → the app that answers 429 in the API's shape at that path.
LimitRefusal = Callable[[str, OverLimit], ASGIApp]


class TenantMiddleware:
    """Pure ASGI. On a ``guarded`` path: the key (``Authorization: Bearer`` or ``x-api-key``) is
    looked up, an unknown or missing one answered 401 by ``refuse``; on an ``attributed`` path the
    request's :class:`RequestRecord` goes into the scope (``SCOPE_KEY``) for the routes to admit,
    and is finished (``TenantGate.finish``) with the answer's status once the answer is done.
    On a ``limited`` path (where the app admits requests into the limits) a tenant already over a
    limit that needs no counts is answered 429 by ``over_limit`` at once, its request unread (a
    flood costs the process next to nothing)."""

    def __init__(self, app: ASGIApp, gate: TenantGate, refuse: Refusal, guarded: Callable[[str], bool],
                 attributed: Callable[[str], bool], route_of: Callable[[str], str],
                 limited: Callable[[str], bool] | None = None, over_limit: LimitRefusal | None = None) -> None:
        self.app = app
        self.gate = gate
        self.refuse = refuse
        self.guarded = guarded
        self.attributed = attributed
        self.route_of = route_of
        self.limited = limited
        self.over_limit = over_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or not self.guarded(path):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        rec = self.gate.identify(headers, self.route_of(path))
        if rec is None:
            given = bool(headers.get(b"authorization") or headers.get(b"x-api-key"))
            why = "no API key was given" if not given else "the API key is not valid"
            await self.refuse(path, f"{why}; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")(
                scope, receive, send)
            return
        if not self.attributed(path):
            await self.app(scope, receive, send)
            return
        scope[SCOPE_KEY] = rec
        if self.limited is not None and self.over_limit is not None and self.limited(path):
            refusal = self.gate.early_refusal(rec)
            if refusal is not None:
                try:
                    await self.over_limit(path, refusal)(scope, receive, send)
                finally:
                    rec.status = 429
                    self.gate.finish(rec)
                return
        status = [500]

        async def watching_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and rec.first_token is None and message.get("body"):
                rec.first_token = time.monotonic()
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            rec.status = status[0]
            self.gate.finish(rec)
