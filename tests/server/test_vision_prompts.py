"""What the server sends the engine for a conversation with images equals what transformers'
processor makes of the same messages and images, for each family's tiny checkpoint: the prompt
ids (each image's tokens at its place) and each image's pixels (and Qwen2.5-VL's grid). The same
conversation through the OpenAI, Anthropic and Responses APIs gives the same engine request. The
engine is the fake one (``tests/support/vision_fakes.py``): the model side is ``test_vision_e2e``'s."""

from __future__ import annotations

import base64
from typing import Any

import anthropic
import numpy as np
import openai
import pytest

from tests.support import tiny_vlms
from tests.support.media_host import data_url, encoded
from tests.support.vision_fakes import FakeVisionServer
from tripod.loader.multimodal import VisionProcessor
from tripod.protocol import engine_ipc

QUESTION = "What is in these pictures?"


def _reference(vlm: Any, images: list[Any]) -> Any:
    text = vlm.template(tiny_vlms.messages(QUESTION, len(images)))
    return vlm.processor(text=text, images=images, return_tensors="np")


def _pixels(req: engine_ipc.AddRequest) -> np.ndarray:
    arrays = [np.frombuffer(i.pixels, np.float32).reshape(i.shape) for i in req.images]
    return np.concatenate(arrays) if req.images[0].grid_thw is not None else np.stack(arrays)


@pytest.mark.parametrize("kind", tiny_vlms.KINDS)
def test_every_api_sends_what_transformers_processor_makes(tiny_vlm: Any, kind: str) -> None:
    vlm = tiny_vlm(kind)
    images = [tiny_vlms.image(20, (32, 48)), tiny_vlms.image(21, (64, 32))]
    ref = _reference(vlm, images)
    urls = [data_url(im) for im in images]
    srv = FakeVisionServer(processor=VisionProcessor.from_folder(vlm.folder))
    try:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        oai.chat.completions.create(model="fake-vlm", max_tokens=4, messages=[{"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": QUESTION}]}])
        ant = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        ant.messages.create(model="fake-vlm", max_tokens=4, messages=[{"role": "user", "content": [
            *({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(encoded(im)).decode()}} for im in images),
            {"type": "text", "text": QUESTION}]}])
        oai.responses.create(model="fake-vlm", max_output_tokens=4, input=[{"role": "user", "content": [
            *({"type": "input_image", "image_url": u} for u in urls), {"type": "input_text", "text": QUESTION}]}])
        sent = srv.engine.sent
    finally:
        srv.stop()
    assert len(sent) == 3
    for req in sent:
        assert req.prompt_ids == ref["input_ids"][0].tolist()
        np.testing.assert_array_equal(_pixels(req), np.asarray(ref["pixel_values"], np.float32))
        if kind == "qwen2_5_vl":
            assert [i.grid_thw for i in req.images] == ref["image_grid_thw"].tolist()
        assert [i.hash for i in req.images] == [i.hash for i in sent[0].images]
    assert sent[0].images[0].hash != sent[0].images[1].hash
