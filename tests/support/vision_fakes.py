"""The HTTP side of a vision-language model without one, for fast tests of what the server does
with images: a byte-level tokenizer whose chat template writes ``<image>`` per image part, a
processor that expands each placeholder into tokens (one per 16x16 pixels; ``detail: low`` one in
all) with its ``ImageInput``, and an engine link that records each ``AddRequest`` as it would
cross the pipe (encoded and decoded with the protocol's codec) and answers it at once with the
first characters of its images' hashes (or ``text`` without images). ``FakeVisionServer`` serves
the real app (``build_app``) on them in a thread."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import replace
from typing import Any

import numpy as np
from PIL import Image

from tests.router.stubs import ServerThread
from tripod.config import EngineConfig, ServerConfig
from tripod.protocol import engine_ipc
from tripod.protocol.multimodal import ImageInput
from tripod.protocol.stats import ComputeCard
from tripod.server.answer.text import TextSide
from tripod.server.app import build_app, lifespan_for
from tripod.server.engine_client import EngineClient
from tripod.server.media.loader import ImageLoader
from tripod.server.media.vision import VisionSide
from tripod.server.metrics import ServerMetrics
from tripod.server.state import ServerState, make_gate

TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
            "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_LEN = 512


def tokenizer() -> Any:
    """Every byte a token (ids 0-255), then ``<s>``, ``</s>``, ``<image>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<image>"])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    out.chat_template = TEMPLATE
    return out


def tokens_per_image(img: Image.Image, detail: str | None) -> int:
    return 1 if detail == "low" else max(1, (img.size[0] // 16) * (img.size[1] // 16))


class FakeExpander:
    """A processor: each ``<image>`` placeholder → ``tokens_per_image`` copies of it."""

    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id
        self.calls: list[list[str | None]] = []

    def expand(self, prompt_ids: list[int], images: list[Image.Image], detail: list[str | None] | None = None,
               ) -> tuple[list[int], list[ImageInput]]:
        detail = detail or [None] * len(images)
        self.calls.append(list(detail))
        places = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise ValueError(f"the prompt has {len(places)} image placeholders for {len(images)} images")
        out: list[int] = []
        inputs = []
        last = 0
        for place, img, d in zip(places, images, detail, strict=True):
            out += prompt_ids[last:place]
            n = tokens_per_image(img, d)
            pixels = (np.asarray(img, dtype=np.float32) / 255.0).astype(np.float32)
            shape = list(pixels.shape)
            digest = hashlib.sha256(pixels.tobytes() + str(shape).encode()).hexdigest()
            inputs.append(ImageInput(hash=digest, offset=len(out), length=n, pixels=pixels.tobytes(), shape=shape))
            out += [self.image_token_id] * n
            last = place + 1
        return out + prompt_ids[last:], inputs


class FakeEngine(EngineClient):
    """An engine link with no engine: ``sent`` holds each ``AddRequest`` as the engine would decode
    it; each sequence is answered at once."""

    def __init__(self, config: ServerConfig, text: TextSide, modalities: list[str]) -> None:
        super().__init__(EngineConfig(), config, logging.WARNING)
        self.text = text
        self.modalities = modalities
        self.sent: list[engine_ipc.AddRequest] = []

    def spawn(self) -> None:
        pass

    async def start(self) -> engine_ipc.Ready:
        self.info = engine_ipc.Ready(
            pid=os.getpid(), model_name="fake-vlm", dtype="float32", quantization="none", architecture="FakeVLM",
            context_len=MAX_LEN, max_request_len=MAX_LEN, vocab_size=self.text.vocab_size, max_running=8,
            kv_slots=4096, compute=ComputeCard(backend="fake"), modalities=self.modalities)
        self.last_heartbeat = time.monotonic()
        return self.info

    async def stop(self, timeout: float = 10.0) -> None:
        pass

    def _send(self, msg: engine_ipc.Message) -> None:
        wire = engine_ipc.decode(engine_ipc.encode(msg))  # (what the engine process would get)
        if isinstance(wire, engine_ipc.AddRequest):
            self.sent.append(wire)
            asyncio.get_running_loop().call_soon(self._answer, wire)

    def _answer(self, req: engine_ipc.AddRequest) -> None:
        h = self._handles.get(req.rid)
        if h is None:
            return
        words = " ".join(i.hash[:6] for i in req.images) or "text"
        ids = self.text.encode(words, special=False)[: req.params.max_tokens]
        for i in range(req.params.n):
            h.queue.put_nowait(engine_ipc.SeqOutput(rid=req.rid, index=i, token_ids=ids, finish_reason="stop"))


class FakeVisionServer:
    """The real app on a fake engine: a vision-language model (``modalities`` ["text", "image"]) or,
    with ``vision=False``, a text-only one (no processor). ``processor``: a real one (a checkpoint's
    ``VisionProcessor``, with its tokenizer) instead of ``FakeExpander``."""

    def __init__(self, config: ServerConfig | None = None, vision: bool = True,
                 modalities: list[str] | None = None, processor: Any = None) -> None:
        config = config or ServerConfig()
        tok = tokenizer() if processor is None else processor.tokenizer
        text = TextSide(tok, len(tok))
        metrics = ServerMetrics("fake-vlm")
        self.expander = FakeExpander(tok.convert_tokens_to_ids("<image>")) if processor is None else processor
        side = VisionSide(self.expander, ImageLoader(config)) if vision else None
        self.engine = FakeEngine(config, text, modalities or (["text", "image"] if vision else ["text"]))
        self.state = state = ServerState(
            engine_config=EngineConfig(), config=replace(config), text=text, client=self.engine,
            model_name="fake-vlm", quantization="none", metrics=metrics, gate=make_gate(config, metrics), vision=side)
        self.server = ServerThread(build_app(state, lifespan=lambda _app: lifespan_for(state)))
        self.url = self.server.url
        self.tokenizer = tok

    def stop(self) -> None:
        self.server.stop()
