"""Vision-language models off the float32 reference path: tripod's CPU kernels, the disk tier and
the prefill/decode KV export.

- Kernels: LLaVA (Llama decoder) and Qwen2.5-VL (M-RoPE rows through the fused RoPE + KV write)
  run wholly on the kernels' paged attention, Gemma 3 on the kernels' linears with torch's
  attention (its bidirectional image masks); float32 greedy tokens equal transformers'; in
  bfloat16 a request's tokens are the same alone, batched with a text request, or chunked.
- Disk tier: a saved prompt's image KV comes back from disk for the same image only.
- Export: an image prompt's blocks carry its image keys; a decode engine receiving them hits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import check_greedy_tokens
from tests.support import tiny_vlms
from tripod import Engine, SamplingParams, kernels
from tripod.memory.kv_blocks import HEADER, tokens_of
from tripod.memory.kv_transfer import BlockReceiver
from tripod.protocol.multimodal import ImageSpan

N = 8
PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
ONE = ("What is this?", [(5, (64, 48))])
OTHER = ("What is this?", [(9, (64, 48))])
TEXT = tiny_vlms.messages("Hello there, how are you today?", 0)
needs_kernels = pytest.mark.skipif(kernels.unavailable_reason("avx2") is not None,
                                   reason=f"tripod's CPU kernels unavailable: {kernels.unavailable_reason('avx2')}")


def _engine(vlm: Any, **kw: Any) -> Engine:
    opts = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=8, max_batch_tokens=64, max_running=8)
    return Engine(model=str(vlm.folder), **{**opts, **kw})


def _prompt(eng: Engine, case: tuple[str, list[Any]]) -> Any:
    text, imgs = case
    return eng.image_prompt(tiny_vlms.messages(text, len(imgs)), [tiny_vlms.image(s, size) for s, size in imgs])


def _ref(vlm: Any, case: tuple[str, list[Any]]) -> Any:
    text, imgs = case
    return tiny_vlms.hf_greedy(vlm, vlm.template(tiny_vlms.messages(text, len(imgs))),
                               [tiny_vlms.image(s, size) for s, size in imgs], N)


@needs_kernels
@pytest.mark.parametrize(("kind", "attention"), [("llava-clip", "kernels"), ("qwen2_5_vl", "kernels"),
                                                 ("gemma3", "torch")])
def test_kernels_float32_equal_transformers(tiny_vlm: Any, kind: str, attention: str) -> None:
    vlm = tiny_vlm(kind)
    eng = _engine(vlm, kernels="avx2")
    card = eng.runner.card()
    assert card["backend"] == "cpu" and ("attention" in card) == (attention == "torch"), card
    if attention == "torch":
        assert "both ways" in card["reason"]
    (out,) = eng.generate([_prompt(eng, ONE)], PARAMS)
    check_greedy_tokens(out.token_ids, _ref(vlm, ONE), f"{kind} on the kernels")
    eng.assert_consistent()


@needs_kernels
@pytest.mark.parametrize("kind", ["llava-clip", "qwen2_5_vl"])
def test_kernels_bfloat16_are_batch_and_chunk_invariant(tiny_vlm: Any, kind: str) -> None:
    vlm = tiny_vlm(kind)
    eng = _engine(vlm, dtype="bfloat16", kernels="avx2", enable_prefix_cache=False)
    p = _prompt(eng, ONE)
    (alone,) = eng.generate([p], PARAMS)
    batched = eng.generate([eng.apply_chat_template(TEXT), p], PARAMS)[1]
    whole = _engine(vlm, dtype="bfloat16", kernels="avx2", chunk_size=256, max_batch_tokens=256)
    (unchunked,) = whole.generate([p], PARAMS)
    assert alone.token_ids == batched.token_ids == unchunked.token_ids
    eng.assert_consistent()


def test_disk_tier_serves_an_image_prompt_back_for_that_image_only(tiny_vlm: Any, tmp_path: Path) -> None:
    vlm = tiny_vlm("llava-clip")
    first = _engine(vlm, kv_disk=str(tmp_path), kv_disk_size=0.05)
    one = _prompt(first, ONE)
    first.generate([one], PARAMS)
    first.close()  # the tree saved to the disk tier
    again = _engine(vlm, kv_disk=str(tmp_path), kv_disk_size=0.05)
    try:
        other = _prompt(again, OTHER)
        (miss,) = again.generate([other], PARAMS)
        assert miss.cached_tokens <= other.images[0].offset
        check_greedy_tokens(miss.token_ids, _ref(vlm, OTHER), "other image after a restart")
        (hit,) = again.generate([one], PARAMS)
        end = one.images[0].offset + one.images[0].length
        assert hit.cached_tokens >= end and again.cache.tier_stats.hit_tokens >= end
        check_greedy_tokens(hit.token_ids, _ref(vlm, ONE), "image prompt from the disk tier")
        again.assert_consistent()
    finally:
        again.close()


def test_exported_image_kv_is_keyed_by_the_image(tiny_vlm: Any, tmp_path: Path) -> None:
    vlm = tiny_vlm("qwen2_5_vl")
    prefill, decode = _engine(vlm), _engine(vlm, kv_disk=str(tmp_path), kv_disk_size=0.05)
    try:
        one = _prompt(prefill, ONE)
        want = prefill.generate([one], PARAMS)[0]
        spans = [ImageSpan(im.hash, im.offset, im.length) for im in one.images]
        blocks = prefill.export_kv(one.ids, spans)
        assert len(blocks) == len(one.ids) // 16 and prefill.export_kv(one.ids) == []  # (the text key misses)
        keys = [t for b in blocks for t in tokens_of(b, HEADER.size, 16)]
        im = one.images[0]
        assert all(k < 0 for k in keys[im.offset : im.offset + im.length]) and all(k >= 0 for k in keys[: im.offset])
        rx = BlockReceiver(decode.kv_layout, decode.cache.tier.dir)
        rx.feed(b"".join(blocks))
        other = _prompt(decode, OTHER)
        assert decode.generate([other], PARAMS)[0].cached_tokens <= im.offset
        got = decode.generate([one], PARAMS)[0]
        assert got.cached_tokens >= im.offset + im.length and got.token_ids == want.token_ids
        decode.assert_consistent()
    finally:
        prefill.close()
        decode.close()
