"""Vision-language models through tripod's engine, token for token against transformers (float32).

Each family's tiny checkpoint (``tests/support/tiny_vlms.py``) is served by an ``Engine`` on the
reference path with chunks shorter than an image's tokens; prompts come from the checkpoint's own
chat template and processor (``Engine.image_prompt``). Checked: greedy tokens equal transformers'
``generate`` alone, with two images, and batched with a text-only request; an image split across
prefill chunks (LLaVA, Qwen2.5-VL) or kept in one (Gemma 3's bidirectional image attention); the
prefix cache hitting a repeated image (``cached_tokens`` past it) and missing another image with
the same placeholder ids (and answering for that image); ``n`` copies and a retraction encoding
once; the KV invariant after each.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import check_greedy_tokens
from tests.support import tiny_vlms
from tripod import Engine, SamplingParams
from tripod.engine.admission import ImagePrompt

N = 8
PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
LOGPROB_TOL = 2e-4  # float32 against float32: a missed mask or position moves them by 1e-2 and more
# (text, [(image seed, (width, height))]): one image, two images, text only
ONE = ("What is this?", [(5, (64, 48))])
TWO = ("Compare these two.", [(6, (32, 32)), (7, (48, 64))])
TEXT = ("Hello there, how are you today?", [])
OTHER = ("What is this?", [(9, (64, 48))])  # ONE's ids, another image


class Case:
    """A family's folder, transformers model and processor, engines, and cached references."""

    def __init__(self, vlm: Any) -> None:
        self.vlm = vlm
        self.refs: dict[Any, Any] = {}

    def engine(self, **kw: Any) -> Engine:
        opts = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=8, max_batch_tokens=64, max_running=8)
        return Engine(model=str(self.vlm.folder), **{**opts, **kw})

    def prompt(self, eng: Engine, case: tuple[str, list[Any]]) -> Any:
        text, imgs = case
        msgs = tiny_vlms.messages(text, len(imgs))
        if not imgs:
            return eng.apply_chat_template(msgs)
        return eng.image_prompt(msgs, [tiny_vlms.image(s, size) for s, size in imgs])

    def ref(self, case: tuple[str, list[Any]]) -> Any:
        key = (case[0], tuple(case[1]))
        if key not in self.refs:
            text, imgs = case
            self.refs[key] = tiny_vlms.hf_greedy(self.vlm, self.vlm.template(tiny_vlms.messages(text, len(imgs))),
                                                 [tiny_vlms.image(s, size) for s, size in imgs], N)
        return self.refs[key]


@pytest.fixture(scope="module")
def case(tiny_vlm: Any) -> Any:
    made: dict[str, Case] = {}

    def get(kind: str) -> Case:
        if kind not in made:
            made[kind] = Case(tiny_vlm(kind))
        return made[kind]

    return get


def _check(out: Any, ref: Any, what: str) -> None:
    """Greedy tokens equal (near ties aside), and each compared token's logprob equal to transformers'
    (a subtler error, e.g. Gemma 3's image tokens not seeing each other both ways, moves logprobs
    long before it flips a token)."""
    same = check_greedy_tokens(out.token_ids, ref, what)
    got = [lp.logprob for lp in out.logprobs[:same]]
    worst = max((abs(a - b) for a, b in zip(got, ref.logprobs, strict=False)), default=0.0)
    assert worst < LOGPROB_TOL, f"{what}: a logprob differs from transformers' by {worst:.3g}"


def _chunks_seen(eng: Engine) -> list[tuple[Any, int, int]]:
    """Record (images, start, length) of every item the runner lays out."""
    seen: list[tuple[Any, int, int]] = []
    build = eng.runner.build_batch

    def spy(items: list[Any]) -> Any:
        seen.extend((it.req.images, it.start, it.length) for it in items)
        return build(items)

    eng.runner.build_batch = spy  # type: ignore[method-assign]
    return seen


def _split_images(seen: list[tuple[Any, int, int]]) -> int:
    """How many chunks ended strictly inside an image."""
    return sum(1 for imgs, s, n in seen if imgs is not None
               for im in imgs.inputs if im.offset < s + n < im.offset + im.length)


@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_greedy_equals_transformers_alone_and_batched(case: Any, kind: str) -> None:
    c = case(kind)
    eng = c.engine()
    seen = _chunks_seen(eng)
    cases = [ONE, TWO, TEXT]
    prompts = [c.prompt(eng, x) for x in cases]
    for x, p in zip(cases, prompts, strict=True):
        (out,) = eng.generate([p], PARAMS)
        _check(out, c.ref(x), f"{kind} {x[0]!r} alone")
        eng.assert_consistent()
    eng.reset_prefix_cache()
    calls: list[int] = []
    encode = eng.runner.model.encode

    def counted(pixels: list[Any], grids: list[Any]) -> Any:
        calls.append(len(pixels))
        return encode(pixels, grids)

    eng.runner.model.encode = counted  # type: ignore[method-assign]
    outs = eng.generate(prompts, PARAMS)  # one step mixes the image prompts' chunks and the text prompt
    assert sum(calls) == 3 and max(calls) >= 2, f"images of two requests were not encoded in one call: {calls}"
    for x, out in zip(cases, outs, strict=True):
        _check(out, c.ref(x), f"{kind} {x[0]!r} batched")
    eng.assert_consistent()
    assert eng.snapshot().vision.images_held == 0
    if kind == "gemma3":  # its image tokens attend both ways: an image is computed in one chunk
        assert _split_images(seen) == 0
    else:  # chunks of 8 < 12-16 image tokens: images were split, and features spliced across chunks
        assert _split_images(seen) > 0


@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_prefix_cache_hits_a_repeated_image_and_misses_another(case: Any, kind: str) -> None:
    c = case(kind)
    assert c.ref(ONE).tokens != c.ref(OTHER).tokens, "the test needs images that change the answer"
    eng = c.engine()
    one, other = c.prompt(eng, ONE), c.prompt(eng, OTHER)
    assert one.ids == other.ids and one.images[0].hash != other.images[0].hash
    end = one.images[0].offset + one.images[0].length
    (first,) = eng.generate([one], PARAMS)
    (again,) = eng.generate([one], PARAMS)
    assert first.cached_tokens < one.images[0].offset and again.cached_tokens >= end
    _check(again, c.ref(ONE), f"{kind} repeated image (cache hit)")
    (miss,) = eng.generate([other], PARAMS)
    assert miss.cached_tokens <= other.images[0].offset, "another image's tokens must never hit"
    _check(miss, c.ref(OTHER), f"{kind} other image, same ids")
    eng.assert_consistent()


def test_n_copies_and_a_retraction_encode_once(case: Any) -> None:
    c = case("qwen2_5_vl")
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, n=3)
    eng = c.engine()
    p = c.prompt(eng, TWO)
    outs = eng.generate([p], params)  # copies 2 and 3 find the prompt's KV in the cache: no image needed
    for out in outs:
        check_greedy_tokens(out.token_ids, c.ref(TWO), "n=3 copy")
    assert (eng.snapshot().vision.images_encoded, eng.snapshot().vision.encoder_cache_hits) == (2, 0)
    eng = c.engine(enable_prefix_cache=False)  # every copy computes its prompt: the features are shared
    outs = eng.generate([p], params)
    for out in outs:
        check_greedy_tokens(out.token_ids, c.ref(TWO), "n=3 copy, no prefix cache")
    stats = eng.snapshot().vision
    assert (stats.images_encoded, stats.encoder_cache_hits) == (2, 4)
    (req,) = eng.add_request(p, PARAMS, request_id="retracted")
    while req.computed < p.images[1].offset + 2:  # past the first image, into the second
        eng.step()
    encoded = eng.snapshot().vision.images_encoded
    eng.scheduler.retract(req)  # its KV given back: the prompt is computed again, images and all
    while not req.finished:
        eng.step()
    eng.step()  # (reports it: the request lets go of its images)
    check_greedy_tokens(req.output_ids, c.ref(TWO), "retracted and recomputed")
    stats = eng.snapshot().vision
    assert encoded == 4 and stats.images_encoded == encoded and stats.images_held == 0
    eng.assert_consistent()


def test_stats_count_images_and_their_tokens(case: Any) -> None:
    c = case("llava-clip")
    eng = c.engine()
    p = c.prompt(eng, TWO)
    eng.generate([p, c.prompt(eng, TEXT)], PARAMS)
    v = eng.snapshot().vision
    assert (v.images_encoded, v.image_tokens, v.images_held) == (2, 32, 0) and v.encoder_seconds > 0
    assert eng.stats.prompt_tokens == len(p.ids) + len(c.prompt(eng, TEXT))


def test_stream_takes_an_image_prompt(case: Any) -> None:
    c = case("gemma3")
    eng = c.engine()
    tokens = [t for d in eng.stream(c.prompt(eng, ONE), PARAMS) for t in d.token_ids]
    check_greedy_tokens(tokens, c.ref(ONE), "stream")
    eng.assert_consistent()


def test_ngram_speculation_verifies_with_mrope_positions(case: Any) -> None:
    c = case("qwen2_5_vl")
    eng = c.engine(speculative="ngram", num_draft_tokens=3)
    (out,) = eng.generate([c.prompt(eng, TWO)], PARAMS)
    check_greedy_tokens(out.token_ids, c.ref(TWO), "ngram speculation")
    eng.assert_consistent()


def test_an_image_prompt_is_a_prompt_with_images(case: Any) -> None:
    c = case("llava-clip")
    eng = c.engine()
    p = c.prompt(eng, ONE)
    (out,) = eng.generate([ImagePrompt(p.ids, p.images)], PARAMS)
    copies = eng.add_request(p.ids, PARAMS, images=p.images)
    while not copies[0].finished:
        eng.step()
    eng.step()
    assert copies[0].output_ids == out.token_ids
    eng.assert_consistent()
