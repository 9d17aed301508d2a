"""Regions on a labelled local fleet: two real ``tripod serve`` replicas, "eu" and "us", and a
``tripod route --region`` for each, every replica labelled on the command line
(``--replica URL,region=NAME``). Each router reaches the other region's replica through a proxy
that delays every byte by 40 ms each way (``tests/support/latency_proxy.py``), as over a link
between regions. Through the official ``openai`` client:

- each router keeps its region's traffic home, with no cross-region request counted;
- past ``--region-overflow-load`` a request overflows to the far region, is counted as overflow,
  and gets the same answer;
- the eu replica SIGKILLed mid-stream: the client's stream through the eu router completes (its
  answer continued in the us region, equal to the undisturbed one), the next requests go to us,
  counted as failover, and the us router never noticed;
- the us router SIGKILLed: a client that sends to it and, on a connection error, to the eu router
  (docs/tenants.md "Regions") sees no failed request.

The replicas run greedy float32, so the same request has the same answer in either region."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from openai import APIConnectionError, OpenAI

from tests.support.latency_proxy import LatencyProxy
from tests.support.server_helpers import ServerProcess, TripodProcess, metric_sum

pytestmark = pytest.mark.slow  # two replicas and two routers: about 45 s (tests/router/test_regions.py covers the policy)

DELAY = 0.04  # seconds each way between the regions
CHAT = [{"role": "user", "content": "Name three things a lighthouse keeper does every day."}]


@dataclass
class Regions:
    eu: ServerProcess
    us: ServerProcess
    route_eu: TripodProcess
    route_us: TripodProcess
    proxies: list[LatencyProxy]  # to us (the eu router's link), to eu (the us router's)


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Regions]:
    tmp = tmp_path_factory.mktemp("regions")
    eu = ServerProcess(tmp, "--threads", "1")
    us = ServerProcess(tmp, "--threads", "1")
    to_us, to_eu = LatencyProxy(us.url, DELAY), LatencyProxy(eu.url, DELAY)
    common = ("--health-interval", "0.2", "--region-overflow-load", "1", "--max-retries", "2")
    route_eu = TripodProcess(tmp, "route", "--region", "eu", "--replica", f"{eu.url},region=eu",
                             "--replica", f"{to_us.url},region=us", *common)
    route_us = TripodProcess(tmp, "route", "--region", "us", "--replica", f"{us.url},region=us",
                             "--replica", f"{to_eu.url},region=eu", *common)
    for router in (route_eu, route_us):
        router.wait_for("both replicas healthy", lambda f: [r["state"] for r in f["replicas"]] == ["healthy"] * 2, 60)
    yield Regions(eu, us, route_eu, route_us, [to_us, to_eu])
    for p in (route_eu, route_us):
        p.stop()
    for s in (eu, us):
        s.stop()
    for proxy in (to_us, to_eu):
        proxy.close()


def _client(router: TripodProcess) -> OpenAI:
    return OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def _chat(router: TripodProcess, **kw: Any) -> tuple[str, str]:
    """(the answer, the URL of the replica that gave it, as the router names it)."""
    raw = _client(router).chat.completions.with_raw_response.create(
        model="default", messages=CHAT, temperature=0, **{"max_tokens": 12, **kw})  # type: ignore[arg-type]
    name = raw.headers["x-tripod-replica"]
    return raw.parse().choices[0].message.content or "", _url_of(router, name)


def _url_of(router: TripodProcess, name: str) -> str:
    rep = router.replica(name)
    assert rep is not None, name
    return str(rep["url"])


def _wait_idle(router: TripodProcess) -> None:
    """The load a router goes by includes what it reads from each replica's /metrics (requests other
    routers sent, and its own until the next read): wait until it has read every replica idle."""
    router.wait_for("every replica idle", lambda f: all(
        r["running"] == 0 and r["waiting"] == 0 and r["inflight"] == 0 for r in f["replicas"]), 30)


def _cross(router: TripodProcess, reason: str) -> float:
    return metric_sum(router.url, "tripod:router_cross_region_requests_total", reason=reason)


def test_each_router_keeps_its_region_home(regions: Regions) -> None:
    answers = set()
    for router, home in ((regions.route_eu, regions.eu.url), (regions.route_us, regions.us.url)):
        for _ in range(3):
            text, url = _chat(router)
            assert url == home, (router.url, url)
            answers.add(text)
        labels = {r["url"]: r["labels"] for r in router.fleet()["replicas"]}
        assert sorted(v["region"] for v in labels.values()) == ["eu", "us"]
        assert _cross(router, "overflow") == _cross(router, "failover") == 0
    assert len(answers) == 1  # one model, greedy: the same answer in both regions


def test_past_the_overflow_load_a_request_is_served_in_the_far_region(regions: Regions) -> None:
    _wait_idle(regions.route_eu)  # the fixture is shared: an earlier test's request may still be counted
    home_answer, home = _chat(regions.route_eu)
    assert home == regions.eu.url
    _wait_idle(regions.route_eu)
    client = _client(regions.route_eu)
    # One long answer streams on the eu replica (its one in-flight request: the overflow load)...
    stream = client.chat.completions.create(model="default", messages=CHAT, temperature=0, max_tokens=200,
                                            stream=True, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    chunks = iter(stream)
    next(chunks)
    # ... so the next request overflows to the us region, through the 40 ms link, with the same answer.
    text, url = _chat(regions.route_eu)
    assert url == regions.proxies[0].url and regions.proxies[0].connections > 0
    assert text == home_answer
    assert _cross(regions.route_eu, "overflow") == 1
    for _ in chunks:
        pass
    _wait_idle(regions.route_eu)
    text, url = _chat(regions.route_eu)  # eu is idle again: home
    assert url == regions.eu.url and text == home_answer


def test_the_eu_region_dies_mid_stream_and_no_request_fails(regions: Regions) -> None:
    client = _client(regions.route_eu)
    kw: dict[str, Any] = {"model": "default", "messages": CHAT, "temperature": 0, "max_tokens": 48}
    want = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(**kw, stream=True)
    pieces: list[str] = []
    for i, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if i == 3:
            regions.eu.proc.send_signal(signal.SIGKILL)  # the whole eu region: its one replica
            regions.eu.proc.wait(10)
            regions.proxies[1].cut()  # and the us router's link to it
    assert "".join(pieces) == want  # continued in the us region, token for token
    for _ in range(3):
        text, url = _chat(regions.route_eu, max_tokens=48)
        assert url == regions.proxies[0].url and text == want
    assert _cross(regions.route_eu, "failover") >= 3
    regions.route_eu.wait_for("eu out of rotation", lambda f: any(
        r["url"] == regions.eu.url and r["state"] != "healthy" for r in f["replicas"]), 30)
    text, url = _chat(regions.route_us, max_tokens=48)  # the us router: home, as before
    assert url == regions.us.url and text == want


def test_one_router_killed_the_other_serves_every_request(regions: Regions) -> None:
    routers = [regions.route_us, regions.route_eu]
    regions.route_us.proc.send_signal(signal.SIGKILL)
    regions.route_us.proc.wait(10)
    refused = 0
    for _ in range(4):
        for router in routers:  # the client's own failover (docs/tenants.md "Regions"): the next router
            try:
                assert _chat(router)[0]
            except APIConnectionError:
                refused += 1
                continue
            break
        else:
            pytest.fail("no router answered")
    assert refused == 4  # every request tried the dead router first, and was answered by the other
