"""Regions over stub replicas: a router prefers replicas in its own region, overflows to others
only past --region-overflow-load, fails over when its region has no routable replica, and counts
what it sent elsewhere; two routers in front of the same replicas keep serving when one stops."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest

from tests.router.stubs import CHAT, MODEL, RouterServer, Stub, wait_for
from tripod.router.replica import parse_replica


def _label(rs: RouterServer, **regions: str) -> None:
    for name, region in regions.items():
        rs.router.replicas[name].labels = {"region": region}


def test_replica_labels_parse() -> None:
    assert parse_replica("http://h:1,region=eu-west, zone = a") == ("http://h:1", {"region": "eu-west", "zone": "a"})
    assert parse_replica("http://h:1") == ("http://h:1", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_replica("http://h:1,eu-west")


def test_local_region_is_preferred(make_stub: Callable[[str], Stub], make_router: Callable[..., RouterServer]) -> None:
    eu1, eu2, us = make_stub("eu1"), make_stub("eu2"), make_stub("us")
    rs = make_router([eu1, eu2, us], region="eu")
    _label(rs, eu1="eu", eu2="eu", us="us")
    for _ in range(10):
        assert rs.post().status_code == 200
    assert us.posts == 0 and eu1.posts == eu2.posts == 5
    assert rs.metric("tripod:router_cross_region_requests_total") == 0
    assert rs.replica("us")["labels"] == {"region": "us"}


def test_overflow_past_the_load_threshold(make_stub: Callable[[str], Stub],
                                          make_router: Callable[..., RouterServer]) -> None:
    eu, us = make_stub("eu"), make_stub("us")
    eu.mode = "hold"
    rs = make_router([eu, us], region="eu", region_overflow_load=2)
    _label(rs, eu="eu", us="us")
    held = [threading.Thread(target=rs.post) for _ in range(2)]
    held[0].start()
    wait_for(lambda: eu.active == 1, "one request held on eu")
    assert us.posts == 0
    held[1].start()  # eu has 1 in flight, below the threshold of 2: still local
    wait_for(lambda: eu.active == 2, "two requests held on eu")
    assert us.posts == 0
    assert rs.post().status_code == 200  # eu is at the threshold: this one overflows
    assert us.posts == 1, (us.posts, eu.posts, rs.fleet())
    assert rs.metric("tripod:router_cross_region_requests_total", region="us", reason="overflow") == 1
    eu.release.set()
    for t in held:
        t.join(15)
    wait_for(rs.idle, "the held requests to finish")
    eu.mode = "ok"
    assert rs.post().status_code == 200 and us.posts == 1  # below the threshold again: back home


def test_failover_when_the_region_dies(make_stub: Callable[[str], Stub],
                                       make_router: Callable[..., RouterServer]) -> None:
    eu, us = make_stub("eu"), make_stub("us")
    rs = make_router([eu, us], region="eu")
    _label(rs, eu="eu", us="us")
    assert rs.post().status_code == 200 and eu.posts == 1
    eu.stop()  # the whole region is gone
    for _ in range(6):  # zero failed requests: the first finds eu refusing and retries on us
        assert rs.post().status_code == 200
    wait_for(lambda: rs.states()["eu"] == "unhealthy", "eu out of rotation")
    assert us.posts >= 6
    assert rs.metric("tripod:router_cross_region_requests_total", region="us", reason="failover") >= 5


def test_two_routers_one_stopped_zero_failures(make_stub: Callable[[str], Stub],
                                               make_router: Callable[..., RouterServer]) -> None:
    """Each router probes on its own and shares nothing: a client (or a load balancer) that sends
    to either, and to the other when one does not answer, sees no failure when one router stops."""
    stubs = [make_stub("r0"), make_stub("r1")]
    a, b = make_router(stubs), make_router(stubs)
    urls = [a.url, b.url]

    def send(i: int) -> int:
        for url in (urls[i % 2], urls[(i + 1) % 2]):  # the client's own failover: the other router
            try:
                r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, timeout=10)
            except httpx.TransportError:
                continue
            return r.status_code
        return 0

    assert [send(i) for i in range(6)] == [200] * 6
    a.stop()
    assert [send(i) for i in range(20)] == [200] * 20
    client = b.client()
    assert client.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message.content  # type: ignore[arg-type]
