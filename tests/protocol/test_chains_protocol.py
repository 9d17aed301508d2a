"""The envelopes of a chain call (``tripod.protocol.chains``): the JSON on the wire is what it was
before the envelopes were typed, the callee validates what it decodes, and a caller rebuilds a
callee's error exactly (or describes an answer that is not one)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import msgspec
import pytest

from tripod.chains.errors import ChainletError
from tripod.protocol.chains import (
    EVENT_END,
    ChainCall,
    ErrorBody,
    FieldError,
    ReplicaList,
    StreamEnd,
    call_from_json,
    decode,
    decode_call,
    decode_value,
    encode,
    encode_call,
    sse_event,
    sse_events,
)


def test_the_module_imports_neither_torch_nor_pydantic() -> None:
    code = "import sys, tripod.protocol.chains; assert not {'torch', 'pydantic'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_call_is_the_bare_object_of_its_arguments() -> None:
    call = ChainCall({"topic": "tides", "n": 3, "tags": ["a", {"b": None}], "note": "é"})
    raw = encode_call(call)
    assert json.loads(raw) == call.args
    assert decode_call(raw) == call and decode_call(b"  ") == ChainCall({})
    # Non-finite floats travel as Python's json writes them (a float parameter accepts them back).
    raw = encode_call(ChainCall({"x": math.nan, "y": [math.inf, -math.inf]}))
    assert raw == b'{"x":NaN,"y":[Infinity,-Infinity]}'
    back = decode_call(raw).args
    assert math.isnan(back["x"]) and back["y"] == [math.inf, -math.inf]
    assert math.isnan(decode_value(b"NaN")) and decode_value(b"[1, -Infinity]") == [1, -math.inf]


def test_the_callee_refuses_a_body_that_is_not_an_object_of_arguments() -> None:
    for payload in ([1, 2], "topic", 3, None):
        with pytest.raises(msgspec.ValidationError):
            call_from_json(payload)
    with pytest.raises(msgspec.ValidationError):
        decode_call(b"[1]")
    with pytest.raises(ValueError):
        decode_call(b"{not json")


def _old_body(e: ChainletError) -> dict[str, object]:
    """The error body as it was written before the envelope was typed (a dict, key by key)."""
    kind = "invalid_request_error" if 400 <= e.status < 500 and e.status != 429 else "server_error"
    err: dict[str, object] = {"message": e.message, "type": kind, "param": e.param, "code": e.code,
                              "chainlet": e.chainlet, "path": e.path, "retryable": e.retryable,
                              "detail": e.detail, "status": e.status}
    if e.errors is not None:
        err["errors"] = [{"loc": f.loc, "msg": f.msg, "type": f.type} for f in e.errors]
    return {"error": err}


def test_an_error_body_is_the_same_json_as_before() -> None:
    plain = ChainletError("Critic", "RuntimeError: boom", retryable=True)
    invalid = ChainletError("Critic", "invalid arguments: n: bad", code="invalid_arguments", status=400, param="n",
                            errors=[FieldError(["n"], "bad", "int_parsing"), FieldError(["a", 0], "x", "y")])
    for e in (plain, invalid):
        assert json.loads(e.to_json()) == _old_body(e) == e.body()
        assert list(json.loads(e.to_json())["error"]) == list(_old_body(e)["error"])  # same key order
    assert "errors" not in plain.body()["error"]


def test_a_caller_rebuilds_the_error_exactly() -> None:
    e = ChainletError("Critic", "invalid arguments: n: bad", code="invalid_arguments", status=400, param="n",
                      errors=[FieldError(["n"], "bad", "int_parsing")]).within("Writer")
    back = ChainletError.from_body("Writer", 500, e.to_json())
    assert (back.chainlet, back.path, back.code, back.status, back.retryable, back.param, back.detail) == \
        (e.chainlet, e.path, e.code, e.status, e.retryable, e.param, e.detail)
    assert back.errors == e.errors and back.to_json() == e.to_json()


def test_a_partial_or_foreign_error_body_is_described() -> None:
    # A partial body: the gaps are filled from the answer's status and the chainlet called.
    e = ChainletError.from_body("Critic", 503, b'{"error": {"message": "overloaded"}}')
    assert (e.chainlet, e.path, e.code, e.status, e.retryable, e.detail) == \
        ("Critic", ["Critic"], "chainlet_error", 503, True, "overloaded")
    e = ChainletError.from_body("Critic", 400, b'{"error": {}}')
    assert e.detail == "400" and not e.retryable
    # Not an error body at all (a proxy's page, a wrong type): described with the status.
    for raw in (b"Internal Server Error", b'{"error": "x"}', b"[1]", b'{"error": {"status": "five"}}'):
        e = ChainletError.from_body("Critic", 502, raw)
        assert e.code == "chainlet_error" and e.status == 502 and e.retryable
        assert e.detail.startswith("answered 502: ")


def test_the_small_envelopes_round_trip() -> None:
    assert encode(StreamEnd(2)) == b'{"items":2}'
    replicas = ReplicaList({"Critic": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "Writer": []})
    assert decode(encode(replicas), ReplicaList) == replicas
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"replicas": {"Critic": "http://x"}}', ReplicaList)
    assert decode(encode(ErrorBody(ChainletError("A", "x").envelope().error)), ErrorBody).error.chainlet == "A"


def test_server_sent_events_frame_and_parse() -> None:
    import asyncio

    wire = sse_event(b'"tick 0"') + sse_event(encode(StreamEnd(1)), EVENT_END)
    assert wire == b'data: "tick 0"\n\nevent: end\ndata: {"items":1}\n\n'

    async def parse() -> list[tuple[str, str]]:
        async def lines():  # type: ignore[no-untyped-def]
            for line in wire.decode().split("\n"):
                yield line

        return [ev async for ev in sse_events(lines())]

    events = asyncio.run(parse())
    assert events == [("message", '"tick 0"'), ("end", '{"items":1}')]
    assert decode_value(events[0][1]) == "tick 0"


def test_the_chain_description_round_trips() -> None:
    from tripod.protocol.chains import (
        ChainInfo,
        ChainletInfo,
        ChainletReplicas,
        DependencyInfo,
        EntrypointInfo,
        LLMInfo,
        ModelInfo,
    )
    from tripod.protocol.fleet import ReplicaInfo

    replica = ReplicaInfo(name="r0", url="http://127.0.0.1:1", state="healthy", pid=None, inflight=0,
                          inflight_tokens=0.0, running=0, waiting=0, routed=3, failures=0, restarts=0, continues=True,
                          estimated_hit_rate=0.5, tree_chars=10, labels={}, role="both", kv_tier=None,
                          tier_tree_chars=None, counters={"kv_disk_hits": 2.0})
    info = ChainInfo(
        entrypoint="Writer", file="/x/chain.py", backend="local", streaming=False,
        entrypoint_options=EntrypointInfo(1, None),
        chainlets={"Writer": ChainletInfo(
            streaming=False, input_schema={"type": "object"}, output_schema=None,
            replicas=ChainletReplicas(1, 1, [replica], {"r0": 0}),
            dependencies={"critic": DependencyInfo("Critic", 2, 20, 2)},
            llms={"llm": LLMInfo("judge", {"temperature": 0})})},
        models={"judge": ModelInfo("url", 1, [])})
    assert decode(encode(info), ChainInfo) == info
    listed = json.loads(encode(info))["chainlets"]["Writer"]["replicas"]["list"][0]
    assert list(listed)[-1] == "counters" and listed["state"] == "healthy"  # an unset Ray field is left out
    assert json.loads(encode(info))["chainlets"]["Writer"]["dependencies"]["critic"] == \
        {"chainlet": "Critic", "retries": 2, "timeout_s": 20, "replicas": 2}
