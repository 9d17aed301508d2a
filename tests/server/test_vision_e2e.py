"""Images end to end: a real ``tripod serve --model <tiny VLM folder>`` (the engine process with the
family's vision tower), called with the official ``openai`` and ``anthropic`` clients, its greedy
tokens equal to transformers' ``generate`` (float32, the checkpoint's own processor, the same
messages and images); the prefix cache hits on a repeated image and never on a different one;
text-only requests beside image requests; bad inputs answered with a 400 while the server goes on.

The default run starts one server (LLaVA with a CLIP tower); every family's parity, the cache and
the mixed batch are ``slow`` (CI runs them)."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch

from tests.conftest import Greedy, check_greedy_tokens
from tests.support import tiny_vlms
from tests.support.media_host import MediaHost, data_url, encoded
from tests.support.server_helpers import ServerProcess, TripodProcess

N = 8  # tokens generated per answer
QUESTION = "What is in this picture?"


class Served:
    """A tiny VLM checkpoint served by ``tripod serve``, with its transformers model for reference."""

    def __init__(self, vlm: Any, tmp: Path, *extra: str) -> None:
        self.vlm = vlm
        self.server = ServerProcess(tmp, "--model", str(vlm.folder), "--max-model-len", "1024", *extra)
        self.url = self.server.url
        self.oai = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)
        self.ant = anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0, timeout=120)
        self._refs: dict[tuple[Any, ...], Greedy] = {}

    @torch.inference_mode()
    def reference(self, images: list[Any], question: str = QUESTION) -> Greedy:
        """transformers' greedy tokens for one user turn of ``images`` then ``question`` (never stopping at EOS)."""
        key = (tuple(im.tobytes() for im in images), question)
        if key not in self._refs:
            text = self.vlm.template(tiny_vlms.messages(question, len(images)))
            inputs = self.vlm.processor(text=text, images=images or None, return_tensors="pt")
            out = self.vlm.model.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None,
                                          pad_token_id=self.vlm.tokenizer.pad_token_id, output_scores=True,
                                          return_dict_in_generate=True)
            tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
            scores = torch.stack(out.scores)[:, 0].float()
            top = scores.topk(2)
            self._refs[key] = Greedy(tokens, (top.values[:, 0] - top.values[:, 1]).tolist(), top.indices[:, 1].tolist(),
                                     torch.log_softmax(scores, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist())
        return self._refs[key]

    def chat(self, images: list[Any], question: str = QUESTION, **kw: Any) -> Any:
        parts: list[Any] = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        return self.oai.chat.completions.create(
            model="default", max_tokens=N, temperature=0, messages=[{"role": "user", "content": [
                *parts, {"type": "text", "text": question}]}],
            extra_body={"return_token_ids": True, "ignore_eos": True}, **kw)

    def stop(self) -> None:
        self.server.stop()


def tokens_of(r: Any) -> list[int]:
    return list(r.choices[0].model_extra["token_ids"])


@pytest.fixture(scope="module")
def served(tiny_vlm: Callable[[str], Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Served]]:
    made: dict[str, Served] = {}

    def get(kind: str) -> Served:
        if kind not in made:
            made[kind] = Served(tiny_vlm(kind), tmp_path_factory.mktemp(f"serve-{kind}"),
                                "--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", "3")
        return made[kind]

    yield get
    for s in made.values():
        s.stop()


def test_an_image_through_both_clients_equals_transformers(served: Callable[[str], Served]) -> None:
    """The default run's one real server: OpenAI and Anthropic clients, the same greedy tokens as
    transformers; a bad image gets a 400 and the next request is answered."""
    s = served("llava-clip")
    img = tiny_vlms.image(1, (32, 32))
    ref = s.reference([img])
    r = s.chat([img])
    check_greedy_tokens(tokens_of(r), ref, "openai chat")
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.image_tokens == 16  # 32x32 at CLIP's 8-pixel patches
    m = s.ant.messages.create(model="default", max_tokens=N, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(encoded(img)).decode()}},
        {"type": "text", "text": QUESTION}]}], extra_body={"ignore_eos": True, "temperature": 0})
    assert m.content[0].text == r.choices[0].message.content  # type: ignore[union-attr]
    streamed = s.chat([img], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == r.usage.prompt_tokens
    bad = httpx.post(s.url + "/v1/chat/completions", json={"model": "default", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_image"
    assert s.oai.models.list().data[0].model_dump()["modalities"] == ["text", "image"]
    check_greedy_tokens(tokens_of(s.chat([img])), ref, "after a bad request")


@pytest.mark.slow
@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_every_family_equals_transformers(served: Callable[[str], Served], kind: str) -> None:
    """One image, two images of different sizes (Qwen2.5-VL: different grids), and text only."""
    s = served(kind)
    one = [tiny_vlms.image(2, (32, 32))]
    two = [tiny_vlms.image(3, (32, 48)), tiny_vlms.image(4, (64, 32))]
    for images in (one, two, []):
        check_greedy_tokens(tokens_of(s.chat(images)), s.reference(images), f"{kind}, {len(images)} image(s)")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llava-clip", "qwen2_5_vl"])
def test_a_repeated_image_is_cached_and_a_different_one_is_not(served: Callable[[str], Served], kind: str) -> None:
    s = served(kind)
    a, b = tiny_vlms.image(5, (32, 32)), tiny_vlms.image(6, (32, 32))
    proc_ids = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(a)}}, {"type": "text", "text": QUESTION}]}]}).json()["tokens"]
    from tripod.loader.multimodal import VisionProcessor

    vp = VisionProcessor.from_folder(s.vlm.folder)
    assert vp is not None
    span = [i for i, t in enumerate(proc_ids) if t == vp.model_image_token_id]
    first, end = span[0], span[-1] + 1
    s.chat([a], question=QUESTION + " (warm-up)")  # (the image's KV enters the cache under its hash)
    again = s.chat([a])
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= end  # the image's tokens came from the cache
    check_greedy_tokens(tokens_of(again), s.reference([a]), "a cached image")
    other = s.chat([b])
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens <= first  # never another image's KV
    check_greedy_tokens(tokens_of(other), s.reference([b]), "a different image")
    assert tokens_of(other) != tokens_of(again)


@pytest.mark.slow
def test_text_and_image_requests_side_by_side(served: Callable[[str], Served]) -> None:
    s = served("qwen2_5_vl")
    jobs = [[tiny_vlms.image(7 + i, (32 + 16 * (i % 2), 32))] if i % 2 else [] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(s.chat, jobs))
    for images, r in zip(jobs, answers, strict=True):
        check_greedy_tokens(tokens_of(r), s.reference(images), f"batched, {len(images)} image(s)")


@pytest.mark.slow
def test_images_by_url_and_through_the_responses_api(served: Callable[[str], Served]) -> None:
    s = served("llava-siglip")
    img = tiny_vlms.image(9, (32, 32))
    host = MediaHost({"/x.png": encoded(img)})
    try:
        ref = s.reference([img])
        r = s.oai.chat.completions.create(model="default", max_tokens=N, temperature=0, messages=[{"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": host.url("/x.png")}},
                        {"type": "text", "text": QUESTION}]}], extra_body={"return_token_ids": True, "ignore_eos": True})
        check_greedy_tokens(tokens_of(r), ref, "an image by URL")
        resp = s.oai.responses.create(model="default", max_output_tokens=N, temperature=0, input=[{"role": "user",
            "content": [{"type": "input_image", "image_url": host.url("/x.png")},
                        {"type": "input_text", "text": QUESTION}]}], extra_body={"ignore_eos": True})
        assert resp.output_text == r.choices[0].message.content
        refused = httpx.post(s.url + "/v1/chat/completions", json={"model": "default", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": host.url("/x.png", "localhost")}}]}]})
        assert refused.status_code == 400 and "--allowed-media-domains" in refused.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="at most 3"):
            s.chat([img] * 4)
    finally:
        host.stop()
    check_greedy_tokens(tokens_of(s.chat([img])), ref, "after the refusals")


@pytest.mark.slow
def test_a_fleet_with_prefill_and_decode_replicas_serves_images(
        served: Callable[[str], Served], tmp_path_factory: pytest.TempPathFactory) -> None:
    """``tripod serve --replicas 1 --prefill-replicas 1`` on a VLM: the router forwards the image
    request, the prefill replica loads the image and hands its prompt's KV (image tokens keyed by
    content) to the decode replica, which answers as one replica does."""
    s = served("qwen2_5_vl")
    tmp = tmp_path_factory.mktemp("vision-pd")
    fleet = TripodProcess(tmp, "serve", "--model", str(s.vlm.folder), "--replicas", "1", "--prefill-replicas", "1",
                          "--dtype", "float32", "--kv-cache-tokens", "8192", "--max-model-len", "1024",
                          "--health-interval", "0.2", "--replica-log-dir", str(tmp))
    try:
        fleet.wait_for("a healthy prefill and decode replica", lambda f: sorted(
            r["role"] for r in f["replicas"] if r["state"] == "healthy") == ["decode", "prefill"], 60)
        img = tiny_vlms.image(11, (64, 48))
        question = "Tell me, in as many words as you like, what this picture shows and why it matters."
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="default", max_tokens=N, temperature=0, messages=[{"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": question}]}],
            extra_body={"return_token_ids": True, "ignore_eos": True})
        check_greedy_tokens(tokens_of(r), s.reference([img], question), "through a prefill/decode fleet")
        assert fleet.fleet()["pd"]["ok"] == 1
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        # The decode replica had never seen this prompt: what it found cached is the blocks handed over.
        assert r.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // 16 * 16 > 0
    finally:
        fleet.stop()
