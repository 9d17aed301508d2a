"""The router tests' fixtures: stub replicas and routers over real HTTP (``stubs.py``), each
stopped after the test that made it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.router.stubs import RouterServer, Stub, closed_port_url, wait_for
from tripod.config import RouterConfig


@pytest.fixture
def make_stub() -> Iterator[Callable[[str], Stub]]:
    stubs: list[Stub] = []

    def make(name: str) -> Stub:
        stubs.append(Stub(name))
        return stubs[-1]

    yield make
    for s in stubs:
        s.gate.set()
        s.release.set()
    for s in stubs:
        s.stop()


@pytest.fixture
def make_router(make_stub: Callable[[str], Stub]) -> Iterator[Callable[..., RouterServer]]:
    made: list[RouterServer] = []

    def make(replicas: list[Stub | tuple[str, str]], healthy: list[str] | None = None,
             **overrides: Any) -> RouterServer:
        """A router over ``replicas``; returns once every name in ``healthy`` (default: every stub)
        is routable."""
        settings: dict[str, Any] = dict(policy="round_robin", health_interval=0.1, health_timeout=1.0,
                                        metrics_interval=0.1, open_cooldown=0.2, queue_timeout=2.0,
                                        connect_timeout=2.0, request_timeout=10.0, retry_after=1)
        settings.update(overrides)
        pairs = [(r.name, r.url) if isinstance(r, Stub) else r for r in replicas]
        rs = RouterServer(pairs, RouterConfig(**settings))
        made.append(rs)
        want = healthy if healthy is not None else [r.name for r in replicas if isinstance(r, Stub)]
        wait_for(lambda: all(rs.states().get(n) == "healthy" for n in want), f"replicas {want} routable")
        return rs

    yield make
    for rs in made:
        rs.stop()


@pytest.fixture
def closed_url() -> Iterator[str]:
    url, sock = closed_port_url()
    yield url
    sock.close()
