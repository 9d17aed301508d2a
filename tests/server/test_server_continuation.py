"""A replica continuing another replica's answer (the server's side of the router's failover),
over HTTP on one real ``tripod serve`` (fp32): for every cut point of an answer, the continuation
from that point gives exactly the rest of the undisturbed answer.

The cut points are every resume point the server reported (``tripod_failover``): what a router
has when the replica dies right after forwarding that chunk. Covered: a multi-byte character split
across tokens (and so across the cut), a stop string spanning the cut, tool calls (the parser
primed with what the client has), completions with echo and logprobs (text offsets go on), ``n``
> 1 with seeded sampling, whole answers (their progress stream and a continued result), usage that
adds up, the same id, and bad continuations refused with 400.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.server_helpers import ServerProcess, assert_same_answer

FORCED = "naïve café 🦊 résumé — done"  # multi-byte characters, split across byte-level tokens
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server of its own on one thread (on a busy 2-core machine two threads thrash)."""
    srv = ServerProcess(tmp_path_factory.mktemp("continuation"), "--threads", "1")
    yield srv
    srv.stop()


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def stream(server: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream (up to ``[DONE]``); fails on an error event."""
    out = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        buf = b""
        for b in r.iter_raw():
            buf += b
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                data = ev.decode().removeprefix("data: ")
                if data == "[DONE]":
                    return out
                obj = json.loads(data)
                assert "error" not in obj, obj
                out.append(obj)
    raise AssertionError("the stream ended without [DONE]")


def text_of(chunks: list[dict[str, Any]], index: int = 0) -> str:
    out = []
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == index:
                out.append((ch["delta"].get("content") or "") if "delta" in ch else ch["text"])
    return "".join(out)


def resume_points(chunks: list[dict[str, Any]], index: int = 0) -> list[tuple[list[int], int, int]]:
    """(tokens so far, chars so far, chunks so far) after each chunk that carries a resume point."""
    tokens: list[int] = []
    out = []
    for j, c in enumerate(chunks):
        for ch in c["choices"]:
            if ch["index"] == index and "tripod" in ch:
                tokens = tokens + ch["tripod"]["token_ids"]
                out.append((tokens, ch["tripod"]["chars"], j + 1))
    return out


def continuation(chunks: list[dict[str, Any]], choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tripod_continuation": {"id": chunks[0]["id"], "created": chunks[0]["created"], "choices": choices}}


def check_every_cut(server: Any, path: str, body: dict[str, Any], cuts: int = 3,
                    inside: bool = False) -> list[dict[str, Any]]:
    """Stream ``body`` undisturbed, then continue it from (up to ``cuts``, spread) resume points
    (``inside``: also from up to ``cuts`` single tokens after which the text ends in half a
    character or the start of a stop string): each continuation's text completes the text before
    the cut into the undisturbed one."""
    body = {**body, "tripod_failover": True, "stream_options": {"include_usage": True}}
    ref = stream(server, path, body)
    full = text_of(ref)
    usage = ref[-1]["usage"]
    points = resume_points(ref)
    assert len(points) >= 3, points
    # Every token is reported, in order (special tokens and held-back text included): what the
    # router resumes from is exactly a prefix of the answer.
    assert len(points[-1][0]) == usage["completion_tokens"]
    step = max(1, len(points) // cuts)
    cut_at = [(tokens, chars, text_of(ref[:upto])) for tokens, chars, upto in points[1:-1:step]][:cuts]
    found: list[tuple[list[int], int, str]] = []
    if inside:
        # After single tokens too, where it matters most: the text of the first k tokens ends in
        # half a character, or the stop string has begun.
        all_tokens = points[-1][0]
        for k in range(1, len(all_tokens)):
            raw = post(server, "/detokenize", {"tokens": all_tokens[:k]}).json()["prompt"]
            held = [s[:j] for s in body.get("stop") or [] for j in range(1, len(s)) if raw.endswith(s[:j])]
            if raw.endswith("\ufffd") or held:
                chars = min(len(raw.rstrip("\ufffd")) - max(map(len, held), default=0), len(full))
                found.append((all_tokens[:k], chars, full[:chars]))
        assert found, "no cut inside a character or a stop string"
        cut_at += found[:: max(1, len(found) // cuts)][:cuts]
    for tokens, chars, before in cut_at:
        assert chars == len(before)
        got = stream(server, path, {**body, **continuation(ref, [{"index": 0, "token_ids": tokens, "chars": chars}])})
        assert before + text_of(got) == full, (len(tokens), before)
        assert {c["id"] for c in got} == {ref[0]["id"]} and {c["created"] for c in got} == {ref[0]["created"]}
        assert not any(ch.get("delta", {}).get("role") for c in got for ch in c["choices"])  # no second role chunk
        finish = [ch["finish_reason"] for c in got for ch in c["choices"] if ch["finish_reason"]]
        assert finish == [ch["finish_reason"] for c in ref for ch in c["choices"] if ch["finish_reason"]]
        u = got[-1]["usage"]  # the prompt counted once, every generated token counted
        assert (u["prompt_tokens"], u["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
    return ref


@pytest.mark.slow
def test_multibyte_characters_split_across_the_cut(server: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 60, "temperature": 0, "logprobs": True,
            "choice": [FORCED], "speculative": False}
    ref = check_every_cut(server, "/v1/chat/completions", body, inside=True)
    assert text_of(ref) == FORCED


def test_stop_string_spanning_the_cut(server: Any) -> None:
    forced = "alpha beta gamma STOP delta epsilon"
    body = {"messages": CHAT, "max_tokens": 60, "temperature": 0, "logprobs": True, "choice": [forced],
            "stop": ["a STO"], "speculative": False}
    ref = check_every_cut(server, "/v1/chat/completions", body, inside=True)
    assert text_of(ref) == "alpha beta gamm"


def test_greedy_free_text_and_completions_with_echo_and_logprobs(server: Any) -> None:
    check_every_cut(server, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Describe the sea in three sentences."}],
                     "max_tokens": 48, "temperature": 0, "ignore_eos": True})
    body = {"prompt": "The history of lighthouses", "max_tokens": 24, "temperature": 0, "echo": True, "logprobs": 2,
            "ignore_eos": True, "tripod_failover": True}
    ref = stream(server, "/v1/completions", body)
    tokens, chars, upto = resume_points(ref)[len(resume_points(ref)) // 2]
    got = stream(server, "/v1/completions", {**body, **continuation(ref, [
        {"index": 0, "token_ids": tokens, "chars": chars}])})
    assert text_of(ref[:upto]) + text_of(got) == text_of(ref)  # the echo is not sent twice

    def lps(chunks: list[dict[str, Any]]) -> tuple[list[str], list[int]]:
        toks: list[str] = []
        offs: list[int] = []
        for c in chunks:
            for ch in c["choices"]:
                if ch["logprobs"]:
                    toks += ch["logprobs"]["tokens"]
                    offs += ch["logprobs"]["text_offset"]
        return toks, offs

    assert (lps(ref[:upto])[0] + lps(got)[0], lps(ref[:upto])[1] + lps(got)[1]) == lps(ref)


def test_tool_calls_continue_mid_arguments(server: Any) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools,
            "tool_choice": "required", "max_tokens": 60, "temperature": 0, "tripod_failover": True}
    ref = stream(server, "/v1/chat/completions", body)

    def calls(chunks: list[dict[str, Any]]) -> tuple[str, str, list[str]]:
        name, args, finish = "", "", []
        for c in chunks:
            for ch in c["choices"]:
                for tc in ch["delta"].get("tool_calls") or []:
                    name += tc["function"].get("name") or ""
                    args += tc["function"].get("arguments") or ""
                if ch["finish_reason"]:
                    finish.append(ch["finish_reason"])
        return name, args, finish

    want = calls(ref)
    assert want[0] == "get_weather" and json.loads(want[1]) and want[2] == ["tool_calls"]
    points = resume_points(ref)
    for tokens, chars, upto in points[1:-1:max(1, len(points) // 3)]:
        got = stream(server, "/v1/chat/completions", {**body, **continuation(ref, [
            {"index": 0, "token_ids": tokens, "chars": chars}])})
        a, b = calls(ref[:upto]), calls(got)
        assert (a[0] + b[0], a[1] + b[1], a[2] + b[2]) == want, len(tokens)


def test_n_copies_seeded_each_continued_from_its_own_point(server: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 30, "temperature": 0.9, "seed": 42, "n": 2, "ignore_eos": True,
            "tripod_failover": True}
    ref = stream(server, "/v1/chat/completions", body)
    p0, p1 = resume_points(ref, 0), resume_points(ref, 1)
    (t0, c0, _), (t1, c1, _) = p0[5], p1[-1]  # choice 1 has finished; choice 0 is cut early
    got = stream(server, "/v1/chat/completions", {**body, **continuation(ref, [
        {"index": 0, "token_ids": t0, "chars": c0},
        {"index": 1, "token_ids": t1, "chars": c1, "finish_reason": "length"}])})
    assert {ch["index"] for c in got for ch in c["choices"]} == {0}  # nothing more of the finished one
    assert text_of(ref, 0)[:c0] + text_of(got, 0) == text_of(ref, 0)


def test_whole_answer_progress_and_continued_result(server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 30, "temperature": 0.7,
            "seed": 3, "n": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "return_token_ids": True}
    plain = post(server, "/v1/chat/completions", body).json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "tripod_failover": True},
                      timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1].startswith("event: result\ndata: ")
    result = json.loads(events[-1].split("data: ", 1)[1])
    for a, b in zip(plain["choices"], result["choices"], strict=True):  # the same answer as without failover
        assert_same_answer((a["message"], a["logprobs"], a["token_ids"]), (b["message"], b["logprobs"], b["token_ids"]))
    progress = [json.loads(e.split("data: ", 1)[1]) for e in events[:-1]]
    assert all(e.startswith("event: progress") for e in events[:-1])
    # Cut after a third of the progress: continue with what it had produced.
    seen: dict[int, dict[str, Any]] = {}
    for p in progress[: len(progress) // 3]:
        s = seen.setdefault(p["index"], {"index": p["index"], "token_ids": [], "logprobs": [], "finish_reason": None})
        s["token_ids"] += p["token_ids"]
        s["logprobs"] += p["logprobs"]
    cont = {"id": result["id"], "created": result["created"], "choices": list(seen.values())}
    got = post(server, "/v1/chat/completions", {**body, "tripod_continuation": cont}).json()
    assert got["id"] == result["id"] and got["created"] == result["created"]
    assert got["choices"] == result["choices"]
    assert (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == \
        (result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"])


@pytest.mark.parametrize("cont, why", [
    ({"index": 3, "token_ids": [1], "chars": 0}, "choice indices"),
    ({"index": 0, "token_ids": [1]}, "'chars'"),
    ({"index": 0, "token_ids": [10**8], "chars": 0}, "outside the vocabulary"),
    ({"index": 0, "token_ids": [1], "chars": 0, "finish_reason": "eaten"}, "finish_reason"),
    ({"index": 0, "token_ids": [1, 2, 3, 4, 5], "chars": 0}, "nothing is left"),
])
def test_bad_continuations_are_400(server: Any, cont: dict[str, Any], why: str) -> None:
    body = {"messages": CHAT, "max_tokens": 5, "stream": True,
            "tripod_continuation": {"id": "chatcmpl-x", "created": 1, "choices": [cont]}}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert why in err["message"] and err["type"] == "invalid_request_error"


def test_continuation_the_grammar_refuses_is_400(server: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 20, "choice": ["yes", "no"],
            "tripod_continuation": {"id": "chatcmpl-x", "created": 1, "choices": [
                {"index": 0, "token_ids": [31], "finish_reason": None}]}}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert "output constraint" in r.json()["error"]["message"]
