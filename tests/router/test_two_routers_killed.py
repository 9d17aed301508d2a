"""Two ``tripod route`` processes in front of the same replicas (stubs over real HTTP): one is
killed with SIGKILL while requests are in flight through it, and a client that sends to one router
and, on a connection error, the same request to the other (docs/tenants.md "Regions": how a client or a load
balancer uses both) sees zero failed requests. Nothing is shared between the routers, so the
survivor needs nothing from the dead one."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.router.stubs import MODEL, Stub, wait_for
from tests.support.server_helpers import TripodProcess

CHAT = [{"role": "user", "content": "hi"}]


def send(urls: list[str], errors: list[str]) -> int:
    """One request: to the first router, then (on a connection error) the same one to the next."""
    for url in urls:
        try:
            r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, timeout=30)
        except httpx.TransportError as e:
            errors.append(f"{url}: {type(e).__name__}")
            continue
        return r.status_code
    return 0


def test_two_routers_one_killed_zero_failed_requests(make_stub: Callable[[str], Stub], tmp_path: Path) -> None:
    stubs = [make_stub("r0"), make_stub("r1")]
    args = ["route", "--replica", stubs[0].url, "--replica", stubs[1].url, "--health-interval", "0.1"]
    a = TripodProcess(tmp_path, *args)
    b = TripodProcess(tmp_path, *args)
    try:
        errors: list[str] = []
        assert [send([a.url, b.url], errors) for _ in range(4)] == [200] * 4
        assert [send([b.url, a.url], errors) for _ in range(4)] == [200] * 4
        # Requests in flight through A when it dies: held in the replicas until A is gone.
        for s in stubs:
            s.mode = "hold"
        results: list[int] = []
        lock = threading.Lock()

        def client() -> None:
            status = send([a.url, b.url], errors)
            with lock:
                results.append(status)

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(s.active for s in stubs) == 4, "four requests in flight through router A")
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        for s in stubs:
            s.release.set()
        for t in threads:
            t.join(60)
        assert results == [200] * 4
        assert len(errors) == 4  # each in-flight request was cut with A and sent again through B
        # After: A refuses connections; every request still gets its answer through B.
        assert [send([a.url, b.url], errors) for _ in range(10)] == [200] * 10
        assert len(errors) == 14
    finally:
        a.stop()
        assert b.stop() == 0
