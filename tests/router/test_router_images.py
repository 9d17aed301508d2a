"""Requests with images through the router: forwarded byte for byte (bodies of megabytes admitted
by the default --max-body-bytes), and routed as prompts in which each image is a mark of its own
(the same image, the same prefix; different images never one)."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from tests.router.stubs import MODEL
from tripod.router.prompt import render_prompt

IMG_A = "data:image/png;base64," + base64.b64encode(os.urandom(6 * 2**20)).decode()  # 8 MB of base64
IMG_B = IMG_A[:-8] + "AAAAAAAA"  # differs only at its end


def chat(url: str, text: str = "what is this?") -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}


def messages(data: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "what is this?"}]}]}


def responses(url: str) -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": url}]}]}


def test_image_bodies_are_forwarded_unchanged(make_stub, make_router) -> None:  # type: ignore[no-untyped-def]
    a = make_stub("a")
    rs = make_router([a])
    for path, body in (("/v1/chat/completions", chat(IMG_A)), ("/v1/messages", messages(IMG_A[22:])),
                       ("/v1/responses", responses(IMG_A))):
        raw = json.dumps(body).encode()
        assert len(raw) > 8 * 2**20
        r = rs.http.post(path, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text
        assert a.bodies[-1] == body


def test_a_body_past_the_routers_limit_says_how_to_raise_it(make_stub, make_router) -> None:  # type: ignore[no-untyped-def]
    rs = make_router([make_stub("a")], max_body_bytes=2**20)
    r = rs.http.post("/v1/chat/completions", json=chat(IMG_A))
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


def test_images_are_marks_of_their_own_in_the_routed_prompt() -> None:
    same = render_prompt("/v1/chat/completions", chat(IMG_A))
    assert same == render_prompt("/v1/chat/completions", chat(IMG_A))
    assert same != render_prompt("/v1/chat/completions", chat(IMG_B))
    assert "<|image:" in same and len(same) < 200  # a mark, not the image
    # Anthropic's and the Responses API's image parts are marked the same way, and text parts kept.
    assert "<|image:" in render_prompt("/v1/messages", messages("QUFB"))
    assert render_prompt("/v1/messages", messages("QUFB")) != render_prompt("/v1/messages", messages("QkJC"))
    resp = render_prompt("/v1/responses", responses(IMG_A))
    assert "what is this?" in resp and "<|image:" in resp
    assert render_prompt("/v1/responses", responses("https://x/a.png")) != render_prompt(
        "/v1/responses", responses("https://x/b.png"))


def test_images_neither_weigh_as_text_nor_teach_characters_per_token() -> None:
    """The fair-share cost counts a body's text, not its base64; and a prompt with images (whose
    tokens have no characters) leaves the learned characters-per-token ratio alone."""
    from tripod.config import RouterConfig
    from tripod.router.policy import RouteRequest
    from tripod.router.prompt import image_chars
    from tripod.router.router import Router

    assert image_chars(chat(IMG_A)) == len(IMG_A)
    assert image_chars(messages("QUFB")) == 4 and image_chars(responses("https://x/a.png")) == len("https://x/a.png")
    assert image_chars({"messages": [{"role": "user", "content": "text only"}]}) == 0
    router = Router(RouterConfig())
    before = router.chars_per_token
    usage = json.dumps({"usage": {"prompt_tokens": 700}}).encode()
    router.learn(RouteRequest(render_prompt("/v1/chat/completions", chat(IMG_A)), 10.0, 16.0), usage)
    assert router.chars_per_token == before
    router.learn(RouteRequest("x" * 1400, 10.0, 16.0), usage)  # 2 characters a token: learned
    assert router.chars_per_token < before


def test_an_image_counts_as_tokens_in_the_routers_estimate() -> None:
    from tripod.config import RouterConfig
    from tripod.router.prompt import IMAGE_TOKENS
    from tripod.router.router import Router

    router = Router(RouterConfig())
    text_only = router.route_request("/v1/chat/completions", {"messages": [{"role": "user", "content": "what is this?"}]})
    two = chat(IMG_A)
    two["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "https://x/b.png"}})
    with_images = router.route_request("/v1/chat/completions", two)
    assert with_images.prompt_tokens - text_only.prompt_tokens >= 2 * IMAGE_TOKENS
