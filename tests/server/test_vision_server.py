"""Images through every API of the real app, with the official clients, on a fake engine and
processor (``tests/support/vision_fakes.py``: no model, so this runs in the default suite in
seconds): what reaches the engine (prompt ids with each image's tokens at its place, its
``ImageInput`` in order, ``detail``), usage and token limits counting image tokens, ``/v1/models``,
metrics, and every bad input answered with a 400 in the API's own shape while the server goes on
serving. The same against a real model: ``test_vision_e2e.py``."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.support.media_host import MediaHost, data_url, encoded, picture
from tests.support.vision_fakes import FakeVisionServer, tokens_per_image
from tripod.config import ServerConfig

TENANTS = '[[tenant]]\nname = "small"\nkeys = ["sk-small"]\nmax_context = 100\n\n' \
          '[[tenant]]\nname = "big"\nkeys = ["sk-big"]\n'


@pytest.fixture(scope="module")
def host() -> Iterator[MediaHost]:
    h = MediaHost({"/cat.png": encoded(picture(1, (48, 32))), "/dog.jpg": encoded(picture(2, (32, 32)), "JPEG")},
                  big=300_000)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeVisionServer]:
    tenants = Path(tmp_path_factory.mktemp("vision")) / "tenants.toml"
    tenants.write_text(TENANTS)
    cfg = ServerConfig(limit_mm_per_prompt=3, allowed_media_domains="127.0.0.1", max_image_bytes=200_000,
                       max_image_pixels=200_000, media_fetch_timeout=1.0, tenants=str(tenants),
                       max_body_bytes=2 * 2**20)
    srv = FakeVisionServer(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def text_only() -> Iterator[FakeVisionServer]:
    srv = FakeVisionServer(vision=False)
    yield srv
    srv.stop()


def oai(srv: FakeVisionServer, key: str = "sk-big") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def ant(srv: FakeVisionServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="sk-big", max_retries=0)


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def hashes(srv: FakeVisionServer) -> list[str]:
    return [i.hash[:6] for i in srv.engine.sent[-1].images]


def check_placed(srv: FakeVisionServer) -> None:
    """Each image's span in the prompt sent to the engine holds its placeholder tokens only, in order."""
    req = srv.engine.sent[-1]
    token = srv.expander.image_token_id
    assert sum(i.length for i in req.images) == req.prompt_ids.count(token)
    for a, b in zip(req.images, req.images[1:], strict=False):
        assert a.offset + a.length <= b.offset
    for i in req.images:
        assert req.prompt_ids[i.offset: i.offset + i.length] == [token] * i.length


def test_openai_chat_images_in_order_with_their_tokens_and_detail(vlm: FakeVisionServer, host: MediaHost) -> None:
    pics = [picture(10, (64, 32)), picture(11, (32, 32))]
    msgs = [user("first", image_part(data_url(pics[0]), "high")),
            {"role": "assistant", "content": "seen"},
            user(image_part(host.url("/cat.png")), "and", image_part(data_url(pics[1], "JPEG"), "low"), "?")]
    r = oai(vlm).chat.completions.create(model="fake-vlm", messages=msgs, max_tokens=40)  # type: ignore[arg-type]
    req = vlm.engine.sent[-1]
    assert len(req.images) == 3 and r.choices[0].message.content == " ".join(hashes(vlm))
    assert len(set(hashes(vlm))) == 3
    assert vlm.expander.calls[-1] == ["high", None, "low"]
    assert [i.length for i in req.images] == [8, 6, 1]  # 64x32 and 48x32 at 16x16 a token; low: one
    check_placed(vlm)
    first = np.frombuffer(req.images[0].pixels, np.float32).reshape(req.images[0].shape)
    assert np.array_equal(first, np.asarray(pics[0], np.float32) / 255.0)  # the pixels sent are the image's
    assert r.usage is not None and r.usage.prompt_tokens == len(req.prompt_ids)
    details = r.usage.prompt_tokens_details
    assert details is not None and details.image_tokens == 15 and details.text_tokens == r.usage.prompt_tokens - 15
    text = oai(vlm).chat.completions.create(model="fake-vlm", messages=[user("just text")], max_tokens=8)
    assert text.choices[0].message.content == "text" and not vlm.engine.sent[-1].images
    assert text.usage is not None and text.usage.prompt_tokens_details is not None
    assert text.usage.prompt_tokens_details.image_tokens is None


def test_a_stream_with_an_image(vlm: FakeVisionServer) -> None:
    stream = oai(vlm).chat.completions.create(model="fake-vlm", messages=[user(image_part(data_url(picture(12))), "hi")],
                                              max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hashes(vlm)[0] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(vlm.engine.sent[-1].prompt_ids)


def test_anthropic_image_blocks(vlm: FakeVisionServer, host: MediaHost) -> None:
    b64 = base64.b64encode(encoded(picture(13, (32, 48)))).decode()
    content: Any = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                    {"type": "text", "text": "and"},
                    {"type": "image", "source": {"type": "url", "url": host.url("/dog.jpg")}}]
    c = ant(vlm)
    r = c.messages.create(model="fake-vlm", max_tokens=40, messages=[{"role": "user", "content": content}])
    assert r.content[0].text == " ".join(hashes(vlm))  # type: ignore[union-attr]
    check_placed(vlm)
    prompt = len(vlm.engine.sent[-1].prompt_ids)
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == prompt
    counted = c.messages.count_tokens(model="fake-vlm", messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == prompt


def test_responses_input_images_and_a_follow_up(vlm: FakeVisionServer, host: MediaHost) -> None:
    c = oai(vlm)
    first = c.responses.create(model="fake-vlm", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is"},
        {"type": "input_image", "image_url": data_url(picture(14)), "detail": "low"},
        {"type": "input_image", "image_url": host.url("/cat.png")}]}])
    assert first.output_text == " ".join(hashes(vlm)) and vlm.expander.calls[-1] == ["low", "auto"]
    assert first.usage is not None and first.usage.input_tokens == len(vlm.engine.sent[-1].prompt_ids)
    was = hashes(vlm)
    follow = c.responses.create(model="fake-vlm", previous_response_id=first.id, input="and now?")
    assert hashes(vlm) == was  # the stored turn's images are the follow-up's too
    check_placed(vlm)
    assert follow.output_text == " ".join(was)


def error_of(r: httpx.Response, anthropic_shape: bool) -> dict[str, Any]:
    body = r.json()
    if anthropic_shape:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return {"message": body["error"]["message"]}
    return dict(body["error"])


NOT_IMAGE = "data:image/png;base64," + base64.b64encode(b"<html>hi</html>").decode()
BIG = "data:image/png;base64," + base64.b64encode(encoded(picture(15, (300, 300)))).decode()  # > 200 KB
WIDE = data_url(Image.new("L", (1000, 300)))  # 300000 pixels > 200000 (a few hundred bytes)
LONG = data_url(Image.new("L", (400, 400)))  # 625 tokens > the 512-token context


def chat_body(*parts: Any, role: str = "user") -> dict[str, Any]:
    return {"model": "fake-vlm", "max_tokens": 4, "messages": [{"role": role, "content": list(parts)}]}


def msg_body(source: dict[str, Any]) -> dict[str, Any]:
    return {"model": "fake-vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": "?"}]}]}


def resp_body(part: dict[str, Any]) -> dict[str, Any]:
    return {"model": "fake-vlm", "input": [{"role": "user", "content": [part]}]}


CHAT, MSG, RESP = "/v1/chat/completions", "/v1/messages", "/v1/responses"
# (id, route, body, param (None: not checked), code (None: not checked), words)
BAD: list[tuple[str, str, Any, str | None, str | None, tuple[str, ...]]] = [
    ("not-an-image", CHAT, chat_body(image_part(NOT_IMAGE)), "messages.0.content.0.image_url.url", "invalid_image",
     ("not an image",)),
    ("not-base64", CHAT, chat_body(image_part("data:image/png;base64,%%%")), None, "invalid_image", ("base64",)),
    ("too-many-bytes", CHAT, chat_body(image_part(BIG)), None, "image_too_large", ("--max-image-bytes",)),
    ("too-many-pixels", CHAT, chat_body(image_part(WIDE)), None, "image_too_large", ("1000x300", "--max-image-pixels")),
    ("too-many-images", CHAT, chat_body(*[image_part(data_url(picture(18))) for _ in range(4)]),
     "messages.0.content.3.image_url.url", "too_many_images", ("4 images", "at most 3")),
    ("context", CHAT, chat_body(image_part(LONG)), "messages", "context_length_exceeded", ("625 of them for 1 image",)),
    ("host-not-allowed", CHAT, chat_body(image_part("http://localhost:1/x.png")), None, "image_url_not_allowed",
     ("--allowed-media-domains",)),
    ("fetch-404", CHAT, None, None, "image_fetch_failed", ("HTTP 404",)),
    ("fetch-timeout", CHAT, None, None, "image_fetch_failed", ("--media-fetch-timeout",)),
    ("file-scheme", CHAT, chat_body(image_part("file:///etc/passwd")), "messages.0.content.0.image_url.url",
     "invalid_image_url", ("data: URL",)),
    ("bad-detail", CHAT, chat_body(image_part(data_url(picture(19)), "ultra")), "messages.0.content.0.image_url.detail",
     "invalid_image_detail", ("auto, low, high",)),
    ("no-image-url", CHAT, chat_body({"type": "image_url"}), "messages.0.content.0.image_url", None, ("required",)),
    ("system-image", CHAT, chat_body(image_part(data_url(picture(20))), role="system"), "messages.0.content.0", None,
     ("user messages",)),
    ("audio-part", CHAT, chat_body({"type": "input_audio", "input_audio": {}}), "messages.0.content.0", None,
     ("input_audio",)),
    ("anthropic-not-image", MSG, msg_body({"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}), None,
     None, ("not an image",)),
    ("anthropic-file", MSG, msg_body({"type": "file", "file_id": "f1"}), None, None, ("Files API",)),
    ("anthropic-pdf", MSG, msg_body({"type": "base64", "media_type": "application/pdf", "data": "aGk="}), None, None,
     ("image type",)),
    ("anthropic-tool-result-image", MSG, {"model": "fake-vlm", "max_tokens": 4, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, None, None, ("user messages' content",)),
    ("placeholder-in-text", CHAT, chat_body({"type": "text", "text": "look: <image>"}), "messages", "invalid_image",
     ("'<image>'", "without an image")),
    ("placeholder-beside-an-image", CHAT, chat_body({"type": "text", "text": "<image>"}, image_part(data_url(picture(23)))),
     "messages", "invalid_image", ("2 image placeholder",)),
    ("placeholder-in-completion", "/v1/completions", {"model": "fake-vlm", "prompt": "a <image> b", "max_tokens": 2},
     "prompt", "invalid_image", ("without an image",)),
    ("placeholder-id-in-completion", "/v1/completions", {"model": "fake-vlm", "prompt": [65, 258, 66], "max_tokens": 2},
     "prompt", "invalid_image", ("id 258",)),
    ("responses-file-id", RESP, resp_body({"type": "input_image", "file_id": "file-1"}),
     "input[0].content[0].file_id", None, ("Files API",)),
    ("responses-not-image", RESP, resp_body({"type": "input_image", "image_url": NOT_IMAGE}),
     "input[0].content[0].image_url", "invalid_image", ("not an image",)),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_images_get_a_400_in_the_apis_shape_and_the_server_goes_on(
        vlm: FakeVisionServer, host: MediaHost, case: tuple[str, str, Any, str | None, str | None, tuple[str, ...]],
) -> None:
    name, route, body, param, code, words = case
    if name == "fetch-404":
        body = chat_body(image_part(host.url("/nope.png")))
    if name == "fetch-timeout":
        body = chat_body(image_part(host.url("/hang")))
    sent = len(vlm.engine.sent)
    r = httpx.post(vlm.url + route, json=body, headers={"Authorization": "Bearer sk-big"}, timeout=30)
    assert r.status_code == 400, r.text
    err = error_of(r, route == MSG)
    for w in words:
        assert w in err["message"], (w, err)
    if param is not None:
        assert err["param"] == param, err
    if code is not None and route != MSG:
        assert err["code"] == code, err
    assert len(vlm.engine.sent) == sent  # nothing reached the engine
    ok = oai(vlm).chat.completions.create(model="fake-vlm", messages=[user("still there?")], max_tokens=8)
    assert ok.choices[0].message.content == "text"


def test_a_body_past_the_limit_is_413_saying_how_to_raise_it(vlm: FakeVisionServer) -> None:
    huge = "data:image/png;base64," + "A" * (3 * 2**20)
    r = httpx.post(vlm.url + CHAT, json=chat_body(image_part(huge)), headers={"Authorization": "Bearer sk-big"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


def test_image_tokens_count_in_the_tenants_context_limit(vlm: FakeVisionServer) -> None:
    """The tenant "small" may use 100 tokens of context: a short question fits; the same question
    with a 160x160 image (100 image tokens) does not."""
    small = oai(vlm, "sk-small")
    assert small.chat.completions.create(model="fake-vlm", messages=[user("hi")], max_tokens=4).choices
    with pytest.raises(openai.BadRequestError) as e:
        small.chat.completions.create(model="fake-vlm", messages=[user(image_part(data_url(picture(21, (160, 160)))),
                                                                       "hi")], max_tokens=4)
    assert "max_context" in str(e.value)
    assert tokens_per_image(picture(21, (160, 160)), None) == 100


def test_a_text_only_model_refuses_images_by_name(text_only: FakeVisionServer) -> None:
    c = openai.OpenAI(base_url=text_only.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="fake-vlm", messages=[user("hi", image_part("http://127.0.0.1/x.png"))])
    body: Any = e.value.body
    assert body["code"] == "model_takes_text_only" and body["param"] == "messages.0.content.1.image_url.url"
    assert "takes text only" in body["message"]
    r = httpx.post(text_only.url + MSG, json=msg_body({"type": "base64", "media_type": "image/png",
                                                       "data": base64.b64encode(encoded(picture(1))).decode()}))
    assert r.status_code == 400 and "takes text only" in r.json()["error"]["message"]
    assert c.chat.completions.create(model="fake-vlm", messages=[user("hi")], max_tokens=4).choices[0].message.content
    assert not any(req.images for req in text_only.engine.sent)


def test_models_say_what_the_model_reads(vlm: FakeVisionServer, text_only: FakeVisionServer) -> None:
    assert oai(vlm).models.list().data[0].model_dump()["modalities"] == ["text", "image"]
    assert httpx.get(text_only.url + "/v1/models").json()["data"][0]["modalities"] == ["text"]


def test_a_processor_the_engine_does_not_back_is_not_used() -> None:
    """A checkpoint with a processor whose engine reads text only: images are refused as for a
    text-only model, and /v1/models says text."""
    srv = FakeVisionServer(modalities=["text"])
    try:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["modalities"] == ["text"]
        r = httpx.post(srv.url + CHAT, json=chat_body(image_part(data_url(picture(1)))))
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_takes_text_only"
    finally:
        srv.stop()


def test_metrics_count_images_and_refusals(vlm: FakeVisionServer) -> None:
    def read() -> dict[tuple[str, str], float]:
        page = httpx.get(vlm.url + "/metrics").text
        return {(s.name, s.labels.get("source") or s.labels.get("reason") or ""): s.value
                for f in text_string_to_metric_families(page) for s in f.samples}

    before = read()
    oai(vlm).chat.completions.create(model="fake-vlm", messages=[user(image_part(data_url(picture(22, (32, 32)))))],
                                     max_tokens=4)
    httpx.post(vlm.url + CHAT, json=chat_body(image_part(NOT_IMAGE)), headers={"Authorization": "Bearer sk-big"})
    after = read()

    def grew(key: tuple[str, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew(("tripod:images_received_total", "inline")) == 2
    assert grew(("tripod:images_refused_total", "invalid_image")) == 1
    assert grew(("tripod:image_tokens_total", "")) == 4


def test_openapi_documents_image_parts(vlm: FakeVisionServer) -> None:
    doc = httpx.get(vlm.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "image_url" in schemas["ContentPart"]["properties"]
    assert "image_url" in schemas["ContentPart"]["properties"]["type"]["enum"]
    assert "image" in schemas["Block"]["properties"]["type"]["enum"] and "ImageSource" in schemas
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert models == {"$ref": "#/components/schemas/ModelList"}
    assert schemas["ModelCard"]["properties"]["modalities"]["items"]["enum"] == ["text", "image"]


def test_the_engines_image_counters_become_metrics() -> None:
    """Heartbeats carry the engine's cumulative image counters; the metrics add what is new."""
    from tripod.protocol.stats import EngineStats, VisionStats
    from tripod.server.metrics import ServerMetrics

    m = ServerMetrics("vlm")

    def beat(encoded: int, seconds: float, hits: int, held: int) -> dict[str, float]:
        m.on_heartbeat(EngineStats(running=0, waiting=0, kv_slots=8, kv_free=8, kv_cached=0, kv_pinned=0,
                                   vision=VisionStats(images_encoded=encoded, encoder_seconds=seconds,
                                                      encoder_cache_hits=hits, images_held=held)))
        return {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
                if "image" in s.name}

    beat(2, 0.5, 1, 2)
    got = beat(5, 1.25, 1, 0)
    assert got["tripod:images_encoded_total"] == 5 and got["tripod:image_encoder_seconds_total"] == 1.25
    assert got["tripod:image_encoder_cache_hits_total"] == 1 and got["tripod:images_held"] == 0
    plain = ServerMetrics("text")
    plain.on_heartbeat(EngineStats(running=0, waiting=0, kv_slots=8, kv_free=8, kv_cached=0, kv_pinned=0))
    assert "tripod:images_encoded_total{" not in plain.render().decode()  # (no series: the engine has no images)
