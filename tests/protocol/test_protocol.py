"""tripod.protocol: every message round-trips through its codec, a malformed one is refused with
a message that says what is wrong, and the stats snapshot serves the JSON the engine's stats
always had. No model, no torch."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from tripod.protocol import engine_ipc as ipc
from tripod.protocol.failover import (
    MalformedExtension,
    Progress,
    ResumePoint,
    decode_progress,
    decode_resume_point,
    encode_progress,
)
from tripod.protocol.sampling import GrammarSpec, Resume, SamplingParamError, SamplingParams
from tripod.protocol.stats import (
    STATS_VERSION,
    ComputeCard,
    EngineStats,
    SpecDecodeCounts,
    StepTimes,
)


def _stats(**kw: Any) -> EngineStats:
    base: dict[str, Any] = dict(running=1, waiting=2, kv_slots=64, kv_free=40, kv_cached=10, kv_pinned=3,
                                prefix_hit_tokens=5, prefix_query_tokens=9, generated_tokens=11, prompt_tokens=12,
                                steps=13, retractions=0, jump_forward_proposed=4, jump_forward_accepted=3,
                                prefill_tokens=20, spec_decode={"ngram": SpecDecodeCounts(2, 8, 5)},
                                compute="optimized: tripod CPU kernels (linears, attention, norms; avx2)",
                                compute_card=ComputeCard(backend="cpu", isa="avx2"),
                                time=StepTimes(schedule=0.5, prepare=0.25, decode_forward=1.5, prefill_forward=2.0,
                                               sample=0.125, bookkeeping=0.0625, ipc=0.03125, idle=4.0))
    return EngineStats(**{**base, **kw})


MESSAGES: list[Any] = [
    ipc.AddRequest("r1", [1, 2, 3], SamplingParams(
        max_tokens=7, temperature=0.5, top_k=3, seed=2**62, logprobs=2, stop_token_ids=[4], n=2, priority=-1,
        grammar=GrammarSpec("regex", r"\d+"), logit_bias={5: -100.0, 9: 2.5}, prompt_logprobs=1, speculative=False)),
    ipc.AddRequest("r2", [1], SamplingParams(n=3), [Resume(1, (7, 8)), Resume(2, ())]),
    ipc.AbortRequest("r1-0"),
    ipc.StatsRequest(7),
    ipc.Shutdown(),
    ipc.Ready(pid=42, model_name="m", dtype="float32", quantization="Q4_1", architecture="llama", context_len=2048,
              max_request_len=2048, vocab_size=49152, max_running=16, kv_slots=4096,
              compute=ComputeCard(backend="reference", isa=None, reason="no kernels here")),
    ipc.Outputs([
        ipc.SeqOutput(rid="r1", index=0, token_ids=[5, 6], logprobs=[ipc.Logprob(5, -0.25, [(5, -0.25), (9, -2.0)]),
                                                                    ipc.Logprob(6, -1.0, [])],
                      finish_reason="stop", cached_tokens=3,
                      prompt_logprobs=[ipc.Logprob(1, None, []), ipc.Logprob(2, -3.5, [(4, -1.0)])]),
        ipc.SeqOutput(rid="r2", index=1, token_ids=[], finish_reason="rejected", error="no"),
    ]),
    ipc.Heartbeat(_stats()),
    ipc.StatsReply(3, _stats(consistent=False, inconsistency="slot 3 twice")),
    ipc.Fatal("RuntimeError: boom"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: Any) -> None:
    back = ipc.decode(ipc.encode(msg))
    assert type(back) is type(msg) and back == msg


def test_the_wire_names_fields_and_the_message() -> None:
    # No reliance on field order: a map with the message's name as its tag.
    wire = msgspec.msgpack.decode(ipc.encode(ipc.AbortRequest("x")))
    assert wire == {"type": "AbortRequest", "rid": "x"}
    lp = msgspec.msgpack.decode(ipc.encode(MESSAGES[6]))["items"][0]["logprobs"][0]
    assert lp == [5, -0.25, [[5, -0.25], [9, -2.0]]]  # a logprob keeps its compact [id, logprob, top] form


def test_an_invalid_add_request_is_refused_with_what_a_rejection_needs() -> None:
    wire = msgspec.msgpack.decode(ipc.encode(ipc.AddRequest("r9", [1], SamplingParams(n=4))))
    wire["params"]["temperature"] = math.inf
    with pytest.raises(ipc.InvalidAddRequest) as e:
        ipc.decode(msgspec.msgpack.encode(wire))
    assert e.value.rid == "r9" and e.value.n == 4
    assert "temperature must be in [0, 2] (got inf)" in str(e.value) and "$.params" in str(e.value)
    wire["params"]["temperature"], wire["params"]["n"] = 1.0, 0  # n itself invalid: one rejection
    with pytest.raises(ipc.InvalidAddRequest) as e:
        ipc.decode(msgspec.msgpack.encode(wire))
    assert e.value.n == 1 and "n must be an integer between 1 and 128" in str(e.value)
    wire["params"]["n"], wire["params"]["grammar"] = 1, {"kind": "xml", "value": ""}
    with pytest.raises(ipc.InvalidAddRequest, match="grammar kind must be one of"):
        ipc.decode(msgspec.msgpack.encode(wire))


@pytest.mark.parametrize(("wire", "match"), [
    ({"type": "AbortRequest"}, r"missing required field `rid`"),
    ({"type": "AbortRequest", "rid": 5}, r"Expected `str`, got `int` - at `\$.rid`"),
    ({"type": "Nope"}, r"Invalid value 'Nope' - at `\$.type`"),
    ({"type": "Outputs", "items": [{"rid": "r", "index": 0, "token_ids": [1], "logprobs": [[1, 0.5]]}]},
     r"at `\$.items\[0\].logprobs\[0\]`"),
    ({"type": "Heartbeat", "stats": {"running": 1}}, r"missing required field `waiting` - at `\$.stats`"),
])
def test_a_malformed_message_is_refused_with_where(wire: dict[str, Any], match: str) -> None:
    with pytest.raises(ipc.ProtocolError, match=match):
        ipc.decode(msgspec.msgpack.encode(wire))
    with pytest.raises(ipc.ProtocolError, match="undecodable"):
        ipc.decode(b"\xc1")


def test_stats_of_another_version_are_refused() -> None:
    wire = msgspec.msgpack.decode(ipc.encode(ipc.Heartbeat(_stats())))
    assert wire["stats"]["version"] == STATS_VERSION
    wire["stats"]["version"] = STATS_VERSION + 1
    with pytest.raises(ipc.ProtocolError, match=f"engine stats version {STATS_VERSION + 1}; this server reads"):
        ipc.decode(msgspec.msgpack.encode(wire))


def test_stats_json_is_the_engines_old_dict() -> None:
    """``/debug/engine`` serves ``as_json()``: exactly the dict the engine process used to build."""
    old = {
        "running": 1, "waiting": 2, "kv_slots": 64, "kv_free": 40, "kv_cached": 10, "kv_pinned": 3,
        "prefix_hit_tokens": 5, "prefix_query_tokens": 9, "generated_tokens": 11, "prompt_tokens": 12, "steps": 13,
        "retractions": 0, "jump_forward_proposed": 4, "jump_forward_accepted": 3, "prefill_tokens": 20,
        "spec_decode": {"ngram": [2, 8, 5]},
        "compute": "optimized: tripod CPU kernels (linears, attention, norms; avx2)",
        "compute_card": {"backend": "cpu", "isa": "avx2"},
        "time": {"schedule": 0.5, "prepare": 0.25, "decode_forward": 1.5, "prefill_forward": 2.0, "sample": 0.125,
                 "bookkeeping": 0.0625, "ipc": 0.03125, "idle": 4.0},
    }
    assert _stats().as_json() == old
    assert list(_stats().as_json()) == list(old)  # the same order, too
    # A stats query's reply adds the KV check: null while busy, true, or false with the reason.
    assert _stats(consistent=None).as_json() == {**old, "consistent": None}
    assert _stats(consistent=True).as_json() == {**old, "consistent": True}
    assert _stats(consistent=False, inconsistency="x").as_json() == {**old, "consistent": False, "inconsistency": "x"}
    # The compute card keeps the engine's keys: a null reason stays, an absent one stays absent.
    assert ComputeCard(backend="reference", isa=None, reason=None).as_json() == {
        "backend": "reference", "isa": None, "reason": None}
    card = {"backend": "cpu", "isa": "avx512", "attention": "torch", "reason": "sliding windows"}
    assert ComputeCard(**card).as_json() == card


def test_sampling_params_keep_their_validation() -> None:
    with pytest.raises(SamplingParamError, match=r"top_p must be in \(0, 1\] \(got 0.0\)"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamError, match="logprobs must be an integer"):
        SamplingParams(logprobs=True)  # type: ignore[arg-type]
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(presence_penalty=0.5).needs_penalties
    from tripod.engine import request  # the engine still names them

    assert request.SamplingParams is SamplingParams and request.GrammarSpec is GrammarSpec
    assert request.Resume is Resume


def test_failover_extension_round_trips_and_validates() -> None:
    p = Progress("chatcmpl-1", 1000, 1, [4, 5], [ipc.Logprob(4, -0.5, []), ipc.Logprob(5, -1.0, [(5, -1.0)])], "stop")
    data = encode_progress(p)
    assert msgspec.json.decode(data) == {"id": "chatcmpl-1", "created": 1000, "index": 1, "token_ids": [4, 5],
                                         "logprobs": [[4, -0.5, []], [5, -1.0, [[5, -1.0]]]], "finish_reason": "stop"}
    assert decode_progress(data) == p
    with pytest.raises(MalformedExtension, match=r"malformed progress event: .* `\$.token_ids\[0\]`"):
        decode_progress(b'{"id": "x", "created": 1, "index": 0, "token_ids": ["a"]}')
    mark = ResumePoint([1, 2], 7)
    assert mark.as_json() == {"token_ids": [1, 2], "chars": 7}
    assert decode_resume_point({"token_ids": [1, 2], "chars": 7}) == mark
    with pytest.raises(MalformedExtension, match="missing required field `chars`"):
        decode_resume_point({"token_ids": [1]})


def test_protocol_imports_no_torch() -> None:
    code = ("import sys, tripod.protocol, tripod.protocol.engine_ipc, tripod.protocol.stats, "
            "tripod.protocol.failover, tripod.protocol.sampling; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_launch_spec_round_trips_and_is_validated() -> None:
    """The spawned engine's one argument is a typed ``EngineLaunch`` (the engine config included):
    it round-trips exactly, and a bad field is refused with its path, not read loosely."""
    from tripod.config import EngineConfig
    from tripod.protocol import engine_ipc

    launch = engine_ipc.EngineLaunch(
        engine_config=EngineConfig(dtype="float32", kv_cache_tokens=4096, speculative="ngram"),
        to_engine="ipc:///tmp/x/to", from_engine="ipc:///tmp/x/from", heartbeat_interval=0.5,
        log_level=20, parent_pid=1234)
    text = engine_ipc.encode_launch(launch)
    assert engine_ipc.decode_launch(text) == launch
    with pytest.raises(engine_ipc.ProtocolError, match=r"kv_cache_tokens"):
        engine_ipc.decode_launch(text.replace('"kv_cache_tokens":4096', '"kv_cache_tokens":"many"'))
    with pytest.raises(engine_ipc.ProtocolError, match=r"dtype must be one of"):
        engine_ipc.decode_launch(text.replace('"dtype":"float32"', '"dtype":"int3"'))


def test_health_answers_and_the_routers_lenient_reading() -> None:
    """A tripod server's ``/health`` keeps its JSON shape; the router reads only what it uses and
    takes any other server's answer (vLLM's empty 200, a foreign JSON) as "no continuation"."""
    import json

    from tripod.protocol import health

    ok = json.loads(health.encode(health.Healthy(model="m", engine_pid=7, running=2, waiting=1)))
    assert ok == {"status": "ok", "model": "m", "engine_pid": 7, "running": 2, "waiting": 1, "continuation": True,
                  "role": "both", "kv_tier": None}
    assert json.loads(health.encode(health.Unhealthy(status="draining"))) == {"status": "draining"}
    assert json.loads(health.encode(health.Unhealthy(status="dead", reason="gone"))) == {"status": "dead",
                                                                                          "reason": "gone"}
    got = health.probe(health.encode(health.Healthy(model="m", engine_pid=None, running=0, waiting=0)))
    assert got.continuation and got.model == "m" and got.role == "both" and got.kv_tier is None
    pd = health.probe(health.encode(health.Healthy(model="m", engine_pid=1, running=0, waiting=0, role="decode",
                                                   kv_tier="host:/kv/ab")))
    assert (pd.role, pd.kv_tier) == ("decode", "host:/kv/ab")
    for foreign in (b"", b"{}", b"[1]", b'{"continuation": "yes"}', b"not json"):
        assert health.probe(foreign) == health.HealthProbe(), foreign
