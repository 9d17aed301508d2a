"""The router over real HTTP: stub OpenAI-ish replicas and the router (``stubs.py``, fixtures in
``conftest.py``), and clients (the official ``openai`` one, or httpx) in the test.

Nothing is mocked: the stubs are small Starlette apps whose behaviour each test sets (answer, fail
with a status, cut a stream, hold a request, ...) and which count what they were sent; the router is
``build_router_app`` with a lifespan that starts and stops its ``Router``. State is waited for by
polling with deadlines, never by fixed sleeps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.router.stubs import (
    CHAT,
    MODEL,
    assert_openai_error,
    error_body,
    ok_body,
    ok_stream_bytes,
    prompt_tokens,
    wait_for,
)
from tripod.router.router import render_prompt


# ------------------------------------------------------------------------------------------ tests
def test_pass_through_unchanged_and_streams_unbuffered(make_stub, make_router) -> None:
    a = make_stub("stub-a")
    rs = make_router([a])
    client = rs.client(timeout=5.0)

    # Non-stream: status, bytes and the headers a client may need come back unchanged.
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = {"model": MODEL, "prompt": "hi", "messages": CHAT}
        r = rs.http.post(path, json=body)
        assert r.status_code == 200
        assert r.content == ok_body("stub-a", path, prompt_tokens(body))
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-request-id"] == "req-stub-a"
        assert r.headers["x-tripod-replica"] == "stub-a"
        assert "x-stub-only" not in r.headers  # only the listed headers are passed back
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
    assert raw.headers["x-tripod-replica"] == "stub-a"
    assert raw.parse().choices[0].message.content == "héllo from stub-a ✓"
    done = client.completions.create(model=MODEL, prompt="hi")
    assert done.choices[0].text == "héllo from stub-a ✓"

    # A stream: the exact bytes, chunk by chunk.
    with rs.http.stream("POST", "/v1/chat/completions",
                        json={"model": MODEL, "messages": CHAT, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-tripod-replica"] == "stub-a"
        assert b"".join(r.iter_raw()) == ok_stream_bytes("stub-a")

    # Unbuffered: the stub sends its second chunk only once the client has the first one. A router
    # that buffered would leave the client waiting: its 5 s read timeout fails the test (the stub
    # gives up after 15 s).
    a.mode = "gate"
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
    events = iter(stream)
    first = next(events)
    assert first.choices[0].delta.content == "stub-a#0 "
    assert not a.gate.is_set()
    a.gate.set()
    rest = [c.choices[0].delta.content for c in events]
    assert rest == ["stub-a#1 "]
    wait_for(lambda: a.streams[-1:] == ["done"], "the gated stream to end")
    wait_for(rs.idle, "the router to be idle")


@pytest.mark.parametrize("failure, stream", [("500", False), ("500", True), ("cut_before_first", True),
                                             ("refused", False)])
def test_failures_before_first_byte_are_retried(make_stub, make_router, failure: str, stream: bool) -> None:
    a, b = make_stub("stub-a"), make_stub("stub-b")
    # With connection refused, probes must not take A out of rotation before a request tries it.
    rs = make_router([a, b], health_interval=5.0 if failure == "refused" else 0.1)
    if failure == "refused":
        a.stop()  # its port now refuses connections; the router still believes it healthy
    else:
        a.mode = failure
    client = rs.client()
    n = 10
    for _ in range(n):
        if stream:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, stream=True)
            assert raw.headers["x-tripod-replica"] == "stub-b"
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse())
            assert text == "stub-b#0 stub-b#1 stub-b#2 "
        else:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
            assert raw.headers["x-tripod-replica"] == "stub-b"
            assert raw.parse().choices[0].message.content == "héllo from stub-b ✓"
    assert b.posts == n
    cause = "transport" if failure in ("refused", "cut_before_first") else failure
    retries = rs.metric("tripod:router_retries_total", replica="stub-a", cause=cause)
    if failure == "refused":
        assert a.posts == 0
        assert retries == 1  # the refusal took A out of rotation at once
        assert rs.states()["stub-a"] == "unhealthy"
    else:
        assert 1 <= a.posts <= n  # round robin sent A some; its circuit may have opened in between
        assert retries == a.posts  # every request A failed was retried (on B)
    assert rs.metric("tripod:router_retries_total", replica="stub-b") == 0
    wait_for(rs.idle, "the router to be idle")


def test_stream_cut_midstream_ends_with_error_not_retried(make_stub, make_router) -> None:
    a, b = make_stub("stub-a"), make_stub("stub-b")
    a.mode = "cut_midstream"
    rs = make_router([a, b])  # round robin: the first request goes to the first replica, A
    client = rs.client()
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, stream=True)
    assert raw.headers["x-tripod-replica"] == "stub-a"
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for c in raw.parse():
            got.append(c.choices[0].delta.content)
    assert got == ["stub-a#0 ", "stub-a#1 "]
    assert "stub-a" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "replica_failed"
    assert a.posts == 1 and a.streams == ["cut"]
    assert b.posts == 0  # never sent a second time
    assert rs.metric("tripod:router_stream_failures_total", replica="stub-a") == 1
    assert rs.metric("tripod:router_retries_total") == 0
    wait_for(rs.idle, "the router to be idle")
    # B is fine, and serves the next request (round robin).
    assert client.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message.content \
        == "héllo from stub-b ✓"


def test_replicas_at_capacity_429(make_stub, make_router) -> None:
    a, b = make_stub("stub-a"), make_stub("stub-b")
    a.mode = b.mode = "429"
    rs = make_router([a, b])
    client = rs.client()
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT)
    resp = info.value.response
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "1"
    assert_openai_error(resp, 429, "overloaded")
    assert (a.posts, b.posts) == (1, 1)  # each tried once, without waiting
    assert rs.states() == {"stub-a": "healthy", "stub-b": "healthy"}  # a 429 is not a failure

    # One at capacity, one not: every request is served by the other.
    b.mode = "ok"
    for _ in range(4):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-tripod-replica"] == "stub-b"
    assert a.posts >= 2  # round robin did try A again
    assert b.posts == 1 + 4
    wait_for(rs.idle, "the router to be idle")


def test_no_routable_replica_503_then_circuit_closes(make_stub, make_router, closed_url: str) -> None:
    a = make_stub("stub-a")
    rs = make_router([a, ("dead", closed_url)], healthy=["stub-a"])
    assert rs.states()["dead"] == "starting"  # never answered a probe
    assert rs.http.get("/health").status_code == 200

    a.health = 503  # draining: the router takes it out of rotation
    wait_for(lambda: rs.http.get("/health").status_code == 503, "the router's /health to go 503")
    assert rs.states() == {"stub-a": "unhealthy", "dead": "starting"}
    t0 = time.monotonic()
    r = rs.post()
    waited = time.monotonic() - t0
    assert_openai_error(r, 503, "no_replica")
    assert r.headers["retry-after"] == "1"
    assert 1.5 <= waited < 6.0, waited  # queue_timeout is 2 s
    assert a.posts == 0
    wait_for(rs.idle, "the router to be idle")

    a.health = 200  # back: the circuit closes on a good probe after the cooldown
    raw = rs.client().chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
    assert raw.headers["x-tripod-replica"] == "stub-a"
    assert a.posts == 1
    assert rs.states()["stub-a"] == "healthy"
    assert rs.http.get("/health").status_code == 200


def test_bad_input_answered_by_router(make_stub, make_router) -> None:
    a, b = make_stub("stub-a"), make_stub("stub-b")
    rs = make_router([a, b], max_body_bytes=1024)
    headers = {"content-type": "application/json"}

    assert_openai_error(rs.http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                                     headers=headers), 400, "invalid_json")
    assert_openai_error(rs.http.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)
    assert_openai_error(rs.http.post("/v1/completions", content=b'"a string"', headers=headers), 400)
    big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
    assert_openai_error(rs.http.post("/v1/completions", content=big, headers=headers), 413,
                        "request_too_large")

    def pieces() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for i in range(0, len(big), 256):
            yield big[i:i + 256]

    r = rs.http.post("/v1/completions", content=pieces(), headers=headers)
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, "request_too_large")
    assert_openai_error(rs.http.get("/v1/nope"), 404, "not_found")
    assert_openai_error(rs.http.post("/nope", json={}), 404, "not_found")
    assert_openai_error(rs.http.get("/v1/chat/completions"), 405)
    assert (a.posts, b.posts) == (0, 0)

    # A replica's own 4xx: passed through unchanged, and not retried elsewhere.
    a.mode = b.mode = "400"
    r = rs.post(max_tokens=-1)
    assert r.status_code == 400
    served = r.headers["x-tripod-replica"]
    assert r.content == error_body(served, 400)
    assert a.posts + b.posts == 1
    with pytest.raises(openai.BadRequestError) as info:
        rs.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-1)
    assert info.value.body == json.loads(error_body(info.value.response.headers["x-tripod-replica"], 400))["error"]
    assert a.posts + b.posts == 2
    assert rs.metric("tripod:router_retries_total") == 0
    assert rs.states() == {"stub-a": "healthy", "stub-b": "healthy"}


def test_max_pending_sheds_load_with_429(make_stub, make_router) -> None:
    a = make_stub("stub-a")
    a.mode = "hold"
    rs = make_router([a], max_pending=2)
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(rs.post) for _ in range(2)]
        wait_for(lambda: a.active == 2, "two requests held by the stub")
        assert rs.fleet()["pending"] == 2
        r = rs.post()
        assert_openai_error(r, 429, "overloaded")
        assert r.headers["retry-after"] == "1"
        assert a.posts == 2  # the third never reached a replica
        a.release.set()
        for f in held:
            r = f.result(timeout=10)
            assert r.status_code == 200 and r.content == ok_body("stub-a", "/v1/chat/completions", prompt_tokens({"messages": CHAT}))
    wait_for(rs.idle, "the router to be idle")
    assert rs.post().status_code == 200
    assert rs.metric("tripod:router_http_requests_total", route="/v1/chat/completions", status="429") == 1


def test_client_disconnect_midstream_closes_upstream(make_stub, make_router) -> None:
    a = make_stub("stub-a")
    a.mode = "endless"
    rs = make_router([a])
    with httpx.Client(base_url=rs.url, timeout=5) as c, c.stream(
            "POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "stream": True}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # kept: a dropped iterator closes the connection when collected
        assert next(chunks).startswith(b"data: ")
        assert rs.replica("stub-a")["inflight"] == 1
        assert rs.fleet()["pending"] == 1
        assert next(chunks)  # still streaming
        assert a.streams == []
    # The client is gone: the router drops its upstream connection, and the stub sees its stream
    # cancelled (well before its 10 s of chunks would end).
    wait_for(lambda: a.streams == ["cancelled"], "the stub's stream to be cancelled", timeout=5)
    wait_for(rs.idle, "the router's pending and in-flight counts to be back to 0", timeout=5)
    assert rs.metric("tripod:router_stream_failures_total") == 0
    # And the replica is still routable and serves the next request.
    a.mode = "ok"
    assert rs.post().status_code == 200


def test_client_gone_before_the_answer_frees_the_router(make_stub, make_router) -> None:
    a = make_stub("stub-a")
    a.mode = "hold"
    rs = make_router([a])
    with pytest.raises(httpx.ReadTimeout):  # the client gives up (and closes its connection)
        httpx.post(rs.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT},
                   timeout=httpx.Timeout(5.0, read=0.5))
    assert a.posts == 1
    # The router notices while the replica still holds the request, and lets go of it.
    wait_for(rs.idle, "the router's pending and in-flight counts to be back to 0", timeout=5)
    assert a.active == 1
    a.release.set()
    a.mode = "ok"
    assert rs.post().status_code == 200
    assert rs.metric("tripod:router_retries_total") == 0


def test_cache_aware_keeps_conversations_and_spreads_distinct_ones(make_stub, make_router) -> None:
    a, b = make_stub("stub-a"), make_stub("stub-b")
    rs = make_router([a, b], policy="cache_aware")

    def served(messages: list[dict[str, str]]) -> str:
        r = rs.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 16})
        assert r.status_code == 200
        return str(r.headers["x-tripod-replica"])

    # A conversation whose every turn extends the previous one stays where its prefix is cached.
    messages = [{"role": "system", "content": "You are a terse assistant for the tripod tests."}]
    homes = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} squared, in words?"})
        homes.append(served(messages))
        messages.append({"role": "assistant", "content": f"The answer to question {turn} is {turn * turn}."})
    assert len(set(homes)) == 1, homes

    # Distinct conversations have nothing worth a detour in common (every chat starts with the same
    # rendered role marker, a few characters: not a cached prefix worth steering for), so they tie and
    # share the replicas, even one at a time with no load to balance.
    topics = ["volcanoes", "jazz", "tax law", "knitting", "black holes", "sourdough", "chess openings",
              "monsoons", "Roman roads", "compilers", "beekeeping", "origami", "glaciers", "opera",
              "cryptography", "tides", "lichens", "sailing", "typography", "meteorites"]
    spread = [served([{"role": "user", "content": f"{i}: tell me something about {t}."}])
              for i, t in enumerate(topics)]
    counts = {name: spread.count(name) for name in ("stub-a", "stub-b")}
    assert max(counts.values()) <= 15, counts


# ---------------------------------------------------------------------------- the Anthropic routes
AMSG = [{"role": "user", "content": "Say hi."}]


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and isinstance(body["error"]["message"], str), body
    return str(body["error"]["message"])


def test_anthropic_messages_proxied_with_retries(make_stub, make_router) -> None:
    import anthropic

    a, b = make_stub("stub-a"), make_stub("stub-b")
    rs = make_router([a, b])
    client = anthropic.Anthropic(base_url=rs.url, api_key="the-key", max_retries=0, timeout=10)
    m = client.messages.create(model=MODEL, max_tokens=5, messages=AMSG)
    assert m.content[0].type == "text" and m.content[0].text.startswith("héllo from stub-")
    # The key reaches the replica, whichever header the client used (this SDK sends a Bearer).
    h = (a.headers + b.headers)[0]
    assert h.get("x-api-key") == "the-key" or h.get("authorization") == "Bearer the-key"
    rs.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": AMSG},
                 headers={"x-api-key": "k2", "anthropic-version": "2023-06-01"})
    assert any(h.get("x-api-key") == "k2" and h.get("anthropic-version") == "2023-06-01"
               for h in a.headers + b.headers)
    with client.messages.stream(model=MODEL, max_tokens=5, messages=AMSG) as s:
        text = "".join(s.text_stream)
    assert text in ("stub-a#0 stub-a#1 stub-a#2 ", "stub-b#0 stub-b#1 stub-b#2 ")
    n = client.messages.count_tokens(model=MODEL, messages=AMSG)
    assert n.input_tokens == prompt_tokens({"messages": AMSG})

    # A full replica (Anthropic's 529) or a failing one, before the first byte: tried elsewhere.
    for mode in ("529", "500"):
        a.mode = mode
        before = b.posts
        for _ in range(4):
            raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=AMSG)
            assert raw.headers["x-tripod-replica"] == "stub-b"
        assert b.posts == before + 4
        a.mode = "ok"
        wait_for(lambda: rs.states()["stub-a"] == "healthy", "stub-a routable again")
    # Every replica full: 529 overloaded_error in Anthropic's shape, with Retry-After.
    a.mode = b.mode = "529"
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(model=MODEL, max_tokens=5, messages=AMSG)
    resp = info.value.response
    assert assert_anthropic_error(resp, 529, "overloaded_error") and resp.headers["retry-after"] == "1"
    assert rs.states() == {"stub-a": "healthy", "stub-b": "healthy"}  # full is not failing
    wait_for(rs.idle, "the router to be idle")


def test_anthropic_errors_and_cut_stream_in_anthropic_shape(make_stub, make_router) -> None:
    a = make_stub("stub-a")
    rs = make_router([a], max_body_bytes=1024, max_pending=1)
    headers = {"content-type": "application/json"}
    assert_anthropic_error(rs.http.post("/v1/messages", content=b'{"model": ', headers=headers), 400,
                           "invalid_request_error")
    assert_anthropic_error(rs.http.post("/v1/messages", content=b'"x"', headers=headers), 400,
                           "invalid_request_error")
    big = json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 2000}]})
    assert_anthropic_error(rs.http.post("/v1/messages", content=big, headers=headers), 413, "request_too_large")
    assert_anthropic_error(rs.http.post("/v1/messages/nope", json={}), 404, "not_found_error")
    assert a.posts == 0
    # The router's own load shedding is a rate limit in Anthropic's terms.
    a.mode = "hold"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(rs.http.post, "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": AMSG})
        wait_for(lambda: a.active == 1, "one request held by the stub")
        r = rs.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": AMSG})
        assert_anthropic_error(r, 429, "rate_limit_error")
        a.release.set()
        assert held.result().status_code == 200
    a.mode = "cut_midstream"
    with rs.http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": AMSG,
                                                       "stream": True}) as r:
        raw = b"".join(r.iter_raw()).decode()
    events = [blk.split("\n", 1) for blk in raw.strip().split("\n\n")]
    assert [e[0] for e in events][:3] == ["event: message_start", "event: content_block_start",
                                          "event: content_block_delta"]
    assert events[-1][0] == "event: error"
    err = json.loads(events[-1][1].removeprefix("data: "))
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and "stub-a" in err["error"]["message"]
    wait_for(rs.idle, "the router to be idle")


def test_cache_aware_follows_a_conversation_across_apis(make_stub, make_router) -> None:
    """A conversation begun as OpenAI chat and continued as Anthropic messages renders to the same
    text, so it stays where its prefix is cached; count_tokens does not claim a cached prompt."""
    a, b = make_stub("stub-a"), make_stub("stub-b")
    rs = make_router([a, b], policy="cache_aware")
    system = "You are a terse assistant for the tripod tests. " * 3
    tool = {"name": "lookup", "description": "Look a word up", "input_schema": {"type": "object"}}
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "Look up 'tripod', please."},
            {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "lookup", "arguments": '{"word":"tripod"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a stand with three legs"}]
    r = rs.http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat, "tools": [
        {"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                          "parameters": {"type": "object"}}}]})
    home = r.headers["x-tripod-replica"]
    for turn in range(4):
        msgs = [{"role": "user", "content": "Look up 'tripod', please."},
                {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                  {"type": "tool_use", "id": "c1", "name": "lookup",
                                                   "input": {"word": "tripod"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                              "content": "a stand with three legs"},
                                             {"type": "text", "text": f"Thanks! And question {turn}?"}]}]
        r = rs.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "system": system,
                                               "tools": [tool], "messages": msgs})
        assert r.status_code == 200 and r.headers["x-tripod-replica"] == home
    # count_tokens of a new, long conversation goes somewhere but is not remembered as cached there.
    long_q = [{"role": "user", "content": "Count me: " + "words " * 200}]
    r = rs.http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": long_q})
    assert r.status_code == 200
    assert all(rep.tree.match(render_prompt("/v1/messages", {"messages": long_q})) < 20
               for rep in rs.router.replicas.values())
