"""The engine's images (issue 38): validation, the encoder cache, and each step's image inputs.

``VisionInputs.prepare`` validates a request's ``ImageInput``s against its prompt and the model
(spans inside the prompt, disjoint, made of the model's image token, the image token nowhere else,
the length the tower makes of the pixels, the content digest recomputed, finite pixels) and
builds its ``PromptImages`` (cache key, M-RoPE positions). Anything wrong is a ``ValueError``
naming what to change (the engine process answers it as a rejection), never an engine crash.

Encoder cache: the tower runs once per image content. Its features are kept by digest while any
request holding the image is alive (``hold`` when it is queued, ``release`` when it is reported
finished), so ``n`` > 1 copies, retractions (recomputing a prompt after its KV was given back)
and a second request with the same image reuse them. ``attach`` runs before each forward: the
images whose tokens the step computes and that are not encoded yet are encoded together (one
tower call across requests), then the batch gets the features of its image rows
(``ForwardBatch.images``), M-RoPE cos/sin per row (``rope_table``) and Gemma 3's bidirectional
image masks on its prefill chunks (``PrefillSegment.bidir``). A chunk may end inside an image
(LLaVA, Qwen2.5-VL): the rest of the image's features are spliced into the next chunk, exactly as
if it had been computed at once.

Invariant (``assert_idle``): an engine with no request holds no image features.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tripod.config import EngineConfig
from tripod.engine.images import PromptImages
from tripod.engine.request import Req, SamplingParams
from tripod.engine.scheduler import ScheduledItem
from tripod.layers.batch import ForwardBatch, ImageRows
from tripod.loader.multimodal import VisionProcessor
from tripod.memory.prefix_cache import keyed_with_images
from tripod.models.config import ModelConfig
from tripod.models.llama import LlamaForCausalLM
from tripod.models.multimodal import VisionLanguageModel
from tripod.protocol.multimodal import ImageInput, pixel_hash
from tripod.protocol.stats import VisionStats

log = logging.getLogger(__name__)


def vision_obstacle(config: EngineConfig, mc: ModelConfig) -> str | None:
    """Why this engine configuration cannot serve vision-language model ``mc`` (None: it can)."""
    if mc.vision is None:
        return None
    if config.world_size > 1:
        return "a vision-language model runs in one process (its tower is not sharded): use --replicas"
    if config.lora:
        return "LoRA adapters on a vision-language model are not supported"
    if config.task == "embed":
        return "--task embed pools text prompts; a vision-language model's image inputs are not pooled"
    spec = config.speculative or ""
    if spec and spec != "ngram":
        return (f"--speculative {spec}: a draft model would run without the images (and Qwen2.5-VL's positions); "
                "use --speculative ngram or none")
    return None


@dataclass(slots=True)
class _Encoded:
    image: ImageInput
    holders: int = 0
    features: torch.Tensor | None = None  # [length, hidden], once encoded


class VisionInputs:
    """Owns the image features of the engine's live requests (by content digest, counted by the
    requests holding them) and lays out each step's image inputs (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model if isinstance(model, VisionLanguageModel) else None
        self.entries: dict[str, _Encoded] = {}
        self._holding: dict[str, list[str]] = {}  # request id -> the digests it holds
        self._used: dict[str, set[str]] = {}  # request id -> the digests a step has given it
        self.images_encoded = 0
        self.encoder_seconds = 0.0
        self.image_tokens = 0  # image tokens of admitted prompts
        self.cache_hits = 0  # images a request found encoded already (another copy's or request's)
        self._processor: VisionProcessor | None = None

    def processor(self, folder: str) -> VisionProcessor | None:
        """The checkpoint's own processor and chat template (None: a text-only model), loaded once."""
        if self._processor is None and self.enabled:
            self._processor = VisionProcessor.from_folder(folder)
        return self._processor

    @property
    def enabled(self) -> bool:
        return self.model is not None

    def stats(self) -> VisionStats:
        return VisionStats(images_encoded=self.images_encoded, encoder_seconds=self.encoder_seconds,
                           image_tokens=self.image_tokens, encoder_cache_hits=self.cache_hits,
                           images_held=len(self.entries))

    # ------------------------------------------------------------------ admission
    def prepare(self, ids: list[int], images: Sequence[ImageInput], params: SamplingParams) -> PromptImages | None:
        """Validate ``images`` against the prompt ``ids``; their ``PromptImages`` (None: no images)."""
        model = self.model
        if model is None:
            if images:
                raise ValueError(f"this model takes text only; the request has {len(images)} image(s): send text, "
                                 "or serve a vision-language model")
            return None
        if images and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available for prompts with images")
        end = 0
        for i, im in enumerate(images):
            self._check(i, im, ids, end, model)
            end = im.offset + im.length
        token = model.vision.image_token_id
        if sum(1 for t in ids if t == token) != sum(im.length for im in images):
            raise ValueError(f"the prompt has the image token {token} outside its {len(images)} image(s)' spans; every "
                             "run of image tokens must belong to one image (expand the prompt with the model's processor)")
        if not images:
            return None
        key = keyed_with_images(ids, [(im.hash, im.offset, im.length) for im in images])
        out = PromptImages(list(images), key, whole=model.bidirectional_images)
        rope = model.rope_positions(len(ids), [(im.offset, im.length, im.grid_thw) for im in images])
        if rope is not None:
            out.positions, out.delta = rope
        return out

    @staticmethod
    def _check(i: int, im: ImageInput, ids: list[int], prev_end: int, model: VisionLanguageModel) -> None:
        token = model.vision.image_token_id
        if im.offset < prev_end:
            raise ValueError(f"image {i}: its span starts at {im.offset}, inside the previous image's (which ends at "
                             f"{prev_end}); images must be in prompt order and must not overlap")
        if im.offset + im.length > len(ids):
            raise ValueError(f"image {i}: its span [{im.offset}, {im.offset + im.length}) runs past the prompt's "
                             f"{len(ids)} tokens")
        if any(t != token for t in ids[im.offset : im.offset + im.length]):
            raise ValueError(f"image {i}: the tokens of its span [{im.offset}, {im.offset + im.length}) are not all the "
                             f"model's image token {token}")
        want = model.image_tokens(im.shape, im.grid_thw)
        if want != im.length:
            raise ValueError(f"image {i}: its pixels make {want} image tokens but its span has {im.length}")
        if pixel_hash(im.pixels, im.shape, im.grid_thw) != im.hash:
            raise ValueError(f"image {i}: its hash is not the sha256 of its pixels, shape and grid (protocol.multimodal."
                             "pixel_hash)")
        if not np.isfinite(np.frombuffer(im.pixels, dtype=np.float32)).all():
            raise ValueError(f"image {i}: its pixels are not all finite numbers")

    def hold(self, reqs: list[Req]) -> None:
        """Admitted requests hold their images' entries (features kept while they live)."""
        for req in reqs:
            if req.images is None or req.rid in self._holding:
                continue
            digests = list(dict.fromkeys(im.hash for im in req.images.inputs))
            for im in req.images.inputs:
                self.entries.setdefault(im.hash, _Encoded(im))
            for d in digests:
                self.entries[d].holders += 1
            self._holding[req.rid] = digests
            self.image_tokens += req.images.tokens

    def release(self, req: Req) -> None:
        """A request was reported finished: its images' entries lose a holder (dropped at none)."""
        self._used.pop(req.rid, None)
        for digest in self._holding.pop(req.rid, ()):
            entry = self.entries[digest]
            entry.holders -= 1
            if entry.holders == 0:
                del self.entries[digest]

    def assert_idle(self) -> None:
        """No request alive: no image features held."""
        assert not self.entries and not self._holding and not self._used, (
            f"{len(self.entries)} image encodings held by no running request (leaked)")

    # ------------------------------------------------------------------ each step
    def attach(self, batch: ForwardBatch, items: list[ScheduledItem]) -> None:
        """Encode what the step needs and give ``batch`` its image rows, M-RoPE rows and image masks."""
        model = self.model
        if model is None or not any(it.req.images is not None for it in items):
            return
        self._encode(items)
        self._rows(batch)
        if model.mrope is not None:
            self._rope(batch, model)
        if model.bidirectional_images and batch.prefills:
            self._masks(batch)

    def _encode(self, items: list[ScheduledItem]) -> None:
        todo: dict[str, _Encoded] = {}
        for it in items:
            imgs = it.req.images
            if imgs is None:
                continue
            used = self._used.setdefault(it.req.rid, set())
            for i, _, _ in imgs.overlaps(it.start, it.start + it.length):
                digest = imgs.inputs[i].hash
                entry = self.entries[digest]
                if entry.features is None and digest not in todo:
                    todo[digest] = entry  # encoded once for every request of the step that needs it
                elif digest not in used:
                    self.cache_hits += 1  # another copy's or another request's
                used.add(digest)
        if not todo:
            return
        assert self.model is not None
        t0 = time.perf_counter()
        entries = list(todo.values())
        pixels = [torch.from_numpy(np.frombuffer(e.image.pixels, dtype=np.float32).reshape(e.image.shape).copy())
                  for e in entries]
        feats = self.model.encode(pixels, [e.image.grid_thw for e in entries])
        for e, f in zip(entries, feats, strict=True):
            assert f.shape[0] == e.image.length, "the tower made another number of features than validated"
            e.features = f
        self.images_encoded += len(entries)
        self.encoder_seconds += time.perf_counter() - t0

    def _rows(self, batch: ForwardBatch) -> None:
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for it, first in batch.item_rows:
            imgs = it.req.images  # type: ignore[attr-defined]
            if imgs is None:
                continue
            for i, lo, hi in imgs.overlaps(it.start, it.start + it.length):
                im = imgs.inputs[i]
                feats = self.entries[im.hash].features
                assert feats is not None
                rows.extend(range(first + lo - it.start, first + hi - it.start))
                parts.append(feats[lo - im.offset : hi - im.offset])
        if rows:
            dev = batch.input_ids.device
            batch.images = ImageRows(torch.tensor(rows, dtype=torch.long, device=dev), torch.cat(parts).to(dev))

    @staticmethod
    def _rope(batch: ForwardBatch, model: VisionLanguageModel) -> None:
        assert model.mrope is not None
        t = batch.input_ids.numel()
        pos = torch.empty(3, t, dtype=torch.long)
        for it, first in batch.item_rows:
            imgs = it.req.images  # type: ignore[attr-defined]
            n = it.length
            if imgs is not None and imgs.positions is not None:
                pos[:, first : first + n] = imgs.rope_positions(it.start, n)
            else:  # text only: its sequence positions on every axis (plain RoPE)
                pos[:, first : first + n] = torch.arange(it.start, it.start + n)
        cos, sin = model.mrope.rows(pos)
        batch.rope_table = (torch.arange(t, device=cos.device), cos, sin)

    @staticmethod
    def _masks(batch: ForwardBatch) -> None:
        segments = {seg.start: seg for seg in batch.prefills}
        for it, first in batch.item_rows:
            imgs = it.req.images  # type: ignore[attr-defined]
            seg = segments.get(first)
            if imgs is None or seg is None:
                continue
            spans = imgs.overlaps(it.start, it.start + it.length)
            if not spans:
                continue
            assert seg.prefix_len == it.start
            n = it.length
            mask = torch.zeros(n, it.start + n, dtype=torch.bool)
            for i, lo, hi in spans:
                im = imgs.inputs[i]
                mask[lo - it.start : hi - it.start, im.offset : min(im.offset + im.length, it.start + n)] = True
            seg.bidir = mask.to(batch.input_ids.device)
