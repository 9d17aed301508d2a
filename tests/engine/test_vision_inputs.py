"""What the engine refuses about images (``engine/vision.py``): every bad input a ``ValueError``
naming what to change, never an engine crash, and nothing held afterwards; the configurations a
vision-language model cannot run refused at start; images across the process pipe."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from tests.support import tiny_models, tiny_vlms
from tripod import Engine, SamplingParams
from tripod.config import EngineConfig
from tripod.engine.vision import vision_obstacle
from tripod.loader import load_tokenizer
from tripod.protocol import engine_ipc
from tripod.protocol.multimodal import ImageInput, pixel_hash

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tiny_vlm: Any) -> tuple[Engine, Any]:
    vlm = tiny_vlm("llava-clip")
    eng = Engine(model=str(vlm.folder), dtype="float32", kv_cache_tokens=512, max_running=4, max_batch_tokens=64)
    return eng, eng.image_prompt(tiny_vlms.messages("Two?", 2), [tiny_vlms.image(1), tiny_vlms.image(2)])


def _restamped(im: ImageInput, **changes: Any) -> ImageInput:
    """``im`` changed, its hash recomputed (so that only the change is wrong)."""
    new = msgspec.structs.replace(im, **changes)
    return msgspec.structs.replace(new, hash=pixel_hash(new.pixels, new.shape, new.grid_thw))


def _refused(eng: Engine, ids: list[int], images: list[ImageInput], match: str,
             params: SamplingParams = PARAMS) -> None:
    with pytest.raises(ValueError, match=match):
        eng.add_request(ids, params, images=images)
    assert not eng.has_work and not eng.admission.reqs
    eng.assert_consistent()  # (nothing held: no image features, no KV)


def test_bad_spans_are_refused(llava: tuple[Engine, Any]) -> None:
    eng, p = llava
    a, b = p.images
    _refused(eng, p.ids, [a, msgspec.structs.replace(b, offset=a.offset + 4)], "inside the previous image")
    _refused(eng, p.ids, [b, a], "inside the previous image")  # (out of prompt order)
    _refused(eng, p.ids, [a, msgspec.structs.replace(b, offset=len(p.ids) - 3)], "runs past the prompt")
    _refused(eng, p.ids, [a, msgspec.structs.replace(b, offset=b.offset - 1)], "not all the model's image token")
    _refused(eng, p.ids, [a], "image token 260 outside its 1 image")
    _refused(eng, p.ids, [], "image token 260 outside its 0 image")  # (a text request writing the image token)
    extra = [*p.ids[:2], 260, *p.ids[2:]]
    shifted = [msgspec.structs.replace(im, offset=im.offset + 1) for im in p.images]
    _refused(eng, extra, shifted, "outside its 2 image")


def test_bad_pixels_are_refused(llava: tuple[Engine, Any]) -> None:
    eng, p = llava
    a, b = p.images
    _refused(eng, p.ids, [a, msgspec.structs.replace(b, hash=a.hash)], "hash is not the sha256")
    small = np.zeros((3, 16, 16), dtype=np.float32)
    _refused(eng, p.ids, [a, _restamped(b, pixels=small.tobytes(), shape=[3, 16, 16])], r"takes pixels of shape \[3, 32, 32\]")
    nan = np.frombuffer(b.pixels, dtype=np.float32).copy()
    nan[7] = np.nan
    _refused(eng, p.ids, [a, _restamped(b, pixels=nan.tobytes())], "not all finite")
    _refused(eng, p.ids, [a, _restamped(b, grid_thw=[1, 2, 2])], "takes pixels of shape")
    short = msgspec.structs.replace(b, length=b.length - 1)
    _refused(eng, p.ids, [a, short], "make 16 image tokens but its span has 15")


def test_prompt_logprobs_with_images_are_refused(llava: tuple[Engine, Any]) -> None:
    eng, p = llava
    _refused(eng, p.ids, p.images, "prompt_logprobs are not available",
             SamplingParams(max_tokens=2, prompt_logprobs=1))


def test_the_engine_serves_on_after_refusals(llava: tuple[Engine, Any]) -> None:
    eng, p = llava
    (out,) = eng.generate([p], PARAMS)
    assert len(out.token_ids) == 2 and out.error is None
    eng.assert_consistent()


def test_images_sent_to_a_text_only_model_are_refused(tmp_path: Any, llava: tuple[Engine, Any]) -> None:
    _, p = llava
    folder = tiny_models.save(tiny_models.build_hf("llama"), tmp_path, tiny_vlms.byte_tokenizer("llava"))
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, max_running=4, max_batch_tokens=64)
    _refused(eng, [t if t < 256 else 5 for t in p.ids], p.images, "takes text only")
    with pytest.raises(ValueError, match="takes text only"):
        eng.image_prompt(tiny_vlms.messages("?", 1), [tiny_vlms.image(1)])


@pytest.mark.parametrize(("option", "match"), [
    ({"tensor_parallel_size": 2}, "runs in one process"),
    ({"speculative": "self:1"}, "--speculative self:1"),
    ({"lora": "a=/nowhere"}, "LoRA adapters"),
    ({"task": "embed"}, "--task embed"),
])
def test_configurations_a_vision_model_cannot_run_are_refused(tiny_vlm: Any, option: dict[str, Any], match: str) -> None:
    folder = str(tiny_vlm("qwen2_5_vl").folder)
    mc = load_tokenizer(folder).config
    why = vision_obstacle(EngineConfig(model=folder, **option), mc)
    assert why is not None and match in why
    assert vision_obstacle(EngineConfig(model=folder, speculative="ngram"), mc) is None
    assert vision_obstacle(EngineConfig(model=folder, **option), load_tokenizer(None).config) is None


def test_an_engine_refuses_draft_speculation_on_a_vision_model(tiny_vlm: Any) -> None:
    with pytest.raises(ValueError, match="a draft model would run without the images"):
        Engine(model=str(tiny_vlm("llava-siglip").folder), dtype="float32", speculative="self:1", kv_cache_tokens=256)


def test_images_cross_the_pipe_and_bad_ones_are_rejected(llava: tuple[Engine, Any]) -> None:
    _, p = llava
    msg = engine_ipc.AddRequest("r1", p.ids, PARAMS, images=p.images)
    back = engine_ipc.decode(engine_ipc.encode(msg))
    assert isinstance(back, engine_ipc.AddRequest) and back.images == p.images
    wire = msgspec.msgpack.decode(engine_ipc.encode(msg))
    wire["images"][0]["pixels"] = wire["images"][0]["pixels"][:-4]  # no longer holds its shape
    with pytest.raises(engine_ipc.InvalidAddRequest, match="do not hold shape"):
        engine_ipc.decode(msgspec.msgpack.encode(wire))
