"""Follow-up affinity (``router/affinity.py``): a ``previous_response_id`` follow-up goes to the
replica that answered the previous response, learned from the answers the router passed back,
whole and streamed (the stream's first event split over two chunks); once that replica is not
routable, the follow-up is placed by the policy and still answered. The map is bounded."""

from __future__ import annotations

import json

from tests.router.stubs import MODEL, wait_for
from tripod.router.affinity import ResponseAffinity


def _create(rs, **body) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(response id, replica) of one POST /v1/responses through the router."""
    body = {"model": MODEL, "input": "hi", **body}
    if not body.get("stream"):
        r = rs.http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"], r.headers["x-tripod-replica"]
    with rs.http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
        first = json.loads(raw.split(b"\n\n")[0].removeprefix(b"data: "))
        return first["response"]["id"], r.headers["x-tripod-replica"]


def test_follow_ups_go_back_to_the_replica_that_answered(make_stub, make_router) -> None:
    stubs = [make_stub(f"stub-{c}") for c in "abc"]
    rs = make_router(stubs)  # round robin: without affinity, consecutive requests rotate
    whole, home = _create(rs)
    streamed, home2 = _create(rs, stream=True)
    assert home != home2
    for prev, want in ((whole, home), (streamed, home2)):
        for stream in (False, True):
            for _ in range(2):
                rid, got = _create(rs, previous_response_id=prev, stream=stream)
                assert got == want, f"a follow-up of {prev} went to {got}, not {want}"
                prev = rid  # a chain follows too
    assert rs.metric("tripod:router_routed_total", reason="affinity") == 8
    _, a = _create(rs, previous_response_id="resp_never_seen_here")  # unknown: the policy's choice
    _, b = _create(rs, previous_response_id="resp_never_seen_here")
    assert a != b

    down = next(s for s in stubs if s.name == home)
    down.health = 503
    wait_for(lambda: rs.states()[home] != "healthy", f"{home} out of rotation")
    before = down.posts
    _, got = _create(rs, previous_response_id=whole)
    assert got != home and down.posts == before  # placed elsewhere, and answered
    wait_for(rs.idle, "the router to be idle")


def test_the_affinity_map_is_bounded() -> None:
    aff = ResponseAffinity(max_entries=3)
    for i in range(10):
        aff.remember(f"resp_{i}", f"r{i % 2}")
    assert len(aff) == 3 and aff.replica_of("resp_0") is None and aff.replica_of("resp_9") == "r1"
    aff.replica_of("resp_7")  # used: kept over resp_8
    aff.remember("resp_10", "r0")
    assert aff.replica_of("resp_7") == "r1" and aff.replica_of("resp_8") is None
    aff.learn_whole(b'{"id": "resp_x", "object": "response"}', "r5")
    aff.learn_whole(b'{"id": "chatcmpl-1", "object": "chat.completion"}', "r5")
    aff.learn_whole(b"not json", "r5")
    assert aff.replica_of("resp_x") == "r5" and aff.replica_of("chatcmpl-1") is None
    feed = aff.stream_watcher("r6")
    assert not feed(b'data: {"type": "response.created", "response": {"i')
    assert feed(b'd": "resp_y", "status": "in_progress"}}\n\n')
    assert aff.replica_of("resp_y") == "r6"
    give_up = aff.stream_watcher("r7")
    assert give_up(b"x" * 20000)
