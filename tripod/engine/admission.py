"""Admission: what happens to a request between ``Engine.add_request`` and the scheduler.

A prompt is validated and split into its ``n`` copies (``prepare``); a continuation's resumed
copies are checked (``check_resume``); a constrained request waits while its grammar compiles on a
background thread, and a request that asked for prompt logprobs waits until its prompt is scored
(one group per step). ``poll`` moves whatever is ready into the scheduler. Every request the
engine knows (queued here, in the scheduler, or finished and not yet reported) is in ``reqs``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tripod.engine.images import PromptImages
from tripod.engine.lora import LoraHandle, LoraRegistry
from tripod.engine.request import FinishReason, Req, Resume, SamplingParams
from tripod.engine.sampler import noise_key
from tripod.engine.scheduler import Scheduler
from tripod.engine.structured import GrammarBackend, GrammarError
from tripod.memory.prefix_cache import PrefixCache
from tripod.protocol.multimodal import ImageInput


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A prompt with images for the offline API: token ids with each image's placeholder span
    expanded, and the images (``Engine.image_prompt`` makes one from chat messages)."""

    ids: list[int]
    images: list[ImageInput]


Prompt = str | list[int] | ImagePrompt
# A group of copies whose grammar compiles off the loop: (future, copies, submitted at).
Compiling = tuple[concurrent.futures.Future[Any], list[Req], float]
# Validates a prompt's images and makes their PromptImages (None: no images): engine/vision.py.
ImageCheck = Callable[[list[int], Sequence[ImageInput], SamplingParams], PromptImages | None]


def encode_prompt(tokenizer: Any, vocab_size: int, prompt: Prompt) -> list[int]:
    """Text through the tokenizer (with its special tokens); token ids checked against the vocabulary."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    ids = list(prompt.ids if isinstance(prompt, ImagePrompt) else prompt)
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return ids


class Admission:
    """Validates, holds and queues requests. ``score(req)`` computes a request's prompt logprobs
    (False: no scratch KV yet, try again next step); ``grammars()`` gives the structured-outputs
    backend (created on first use); ``loras``: the engine's adapters (None: it serves none)."""

    def __init__(self, *, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], max_len: Callable[[], int],
                 cache: PrefixCache, scheduler: Scheduler, count_prompt: Callable[[int], None],
                 score: Callable[[Req], bool], grammars: Callable[[], GrammarBackend],
                 loras: LoraRegistry | None, images: ImageCheck | None = None,
                 hold: Callable[[list[Req]], None] | None = None,
                 routing: Callable[[], str | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.max_len = max_len
        self.cache = cache
        self.scheduler = scheduler
        self.count_prompt = count_prompt
        self.score = score
        self.grammars = grammars
        self.loras = loras
        self.images = images
        self.hold = hold  # queued requests hold their images' encoder entries (engine/vision.py)
        # return_routed_experts: why this engine cannot report routing (None: it can).
        self.routing_refusal = routing
        self.reqs: dict[str, Req] = {}
        self.compiling: list[Compiling] = []
        self.scoring: list[list[Req]] = []  # groups waiting for their prompt logprobs, in arrival order
        self._rid_counter = itertools.count()

    @property
    def busy(self) -> bool:
        """Requests held here (compiling or waiting to be scored)."""
        return bool(self.compiling) or bool(self.scoring)

    # ------------------------------------------------------------------ validation
    def prepare(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                resume: Sequence[Resume] | None = None, *, tenant: str = "", weight: float = 1.0,
                images: Sequence[ImageInput] = ()) -> list[Req]:
        """Validate a prompt (and its images) and build its copies without queueing anything."""
        params = params or SamplingParams()
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be > 0 (got {weight})")
        ids = encode_prompt(self.tokenizer, self.vocab_size, prompt)
        if isinstance(prompt, ImagePrompt):
            if images:
                raise ValueError("give the images in the ImagePrompt or as images=, not both")
            images = prompt.images
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        limit = self.max_len()
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context allows at most {limit - 1} "
                f"(context {limit} including at least one generated token); shorten the prompt"
            )
        if params.return_routed_experts:
            why = self.routing_refusal() if self.routing_refusal is not None else "this engine cannot report routing"
            if why is not None:
                raise ValueError(why)
        lora: LoraHandle | None = None
        if params.lora is not None:
            if self.loras is None:
                raise ValueError(f"LoRA adapter {params.lora!r}: this engine serves no adapters (start it with --lora NAME=PATH)")
            lora = self.loras.resolve(params.lora)  # NOTE: the one lookup by name: the handle from here on
        if images and self.images is None:
            raise ValueError(f"this model takes text only; the request has {len(images)} image(s)")
        pictures = self.images(ids, images, params) if self.images is not None else None
        base = request_id or f"req-{next(self._rid_counter)}"
        prior = {r.index: list(r.output_ids) for r in resume} if resume is not None else {}
        if resume is not None:
            self.check_resume(resume, params, ids, limit)
        copies: list[Req] = []
        for i in sorted(prior) if resume is not None else range(params.n):
            rid = base if params.n == 1 else f"{base}-{i}"
            if rid in self.reqs:
                raise ValueError(f"request id {rid!r} is already in use")
            req = Req(
                list(ids), params, rid=rid, eos_ids=self.eos_ids, max_len=limit,
                noise_key=noise_key(params.seed, i) if params.seed is not None else None,
                index=i, group=base, output_ids=prior.get(i, []), tenant=tenant, weight=weight, lora=lora,
                images=pictures,
            )
            if params.return_routed_experts:
                req.routed = []
            if copies and self.cache.enabled:
                req.wait_for = copies[0]
            copies.append(req)
        return copies

    def check_resume(self, resume: Sequence[Resume], params: SamplingParams, ids: list[int], limit: int) -> None:
        """A continuation names distinct copies of the request, each with fewer tokens than it may
        generate and none that would have ended it."""
        if not resume:
            raise ValueError("a continuation must resume at least one copy")
        seen: set[int] = set()
        vocab = self.vocab_size
        for r in resume:
            if not 0 <= r.index < params.n or r.index in seen:
                raise ValueError(f"continuation copy indices must be distinct and in [0, {params.n}) (got {r.index})")
            seen.add(r.index)
            out = list(r.output_ids)
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in out):
                raise ValueError(f"continuation token ids must be integers in [0, {vocab})")
            if len(out) >= params.max_tokens or len(ids) + len(out) >= limit:
                raise ValueError(f"copy {r.index} of the continuation has {len(out)} tokens already: nothing is "
                                 f"left to generate within max_tokens ({params.max_tokens}) and the context ({limit})")
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if any(t in ends for t in out):
                raise ValueError(f"copy {r.index} of the continuation contains a stop token: it had finished")

    # ------------------------------------------------------------------ queueing
    def admit(self, copies: list[Req]) -> None:
        """Queue the copies, or hold them while their grammar compiles."""
        spec = copies[0].params.grammar
        if spec is None:
            self.enqueue(copies)
            return
        for r in copies:
            self.reqs[r.rid] = r
        self.compiling.append((self.grammars().submit(spec), copies, time.monotonic()))

    def enqueue(self, copies: list[Req]) -> None:
        """To the scheduler, or first to prompt scoring when the request asked for prompt logprobs."""
        for req in copies:
            self.reqs[req.rid] = req
        if self.hold is not None:
            self.hold(copies)
        if copies and copies[0].params.prompt_logprobs is not None and copies[0].prompt_logprobs is None:
            self.scoring.append(copies)  # queued once scored (score_prompts)
            return
        for req in copies:
            self.scheduler.add(req)
            self.count_prompt(len(req.prompt_ids))

    def poll(self) -> None:
        """Once per step: queue what finished compiling, then score one waiting prompt."""
        self.poll_compiles()
        self.score_prompts()

    def wait_idle(self) -> None:
        """Nothing to run but grammars compiling: wait a little for one, not spin."""
        if self.compiling and not self.scoring:
            concurrent.futures.wait([f for f, _, _ in self.compiling], timeout=0.005,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ grammars
    def poll_compiles(self) -> None:
        """Queue the requests whose grammar is ready; reject those whose grammar failed."""
        if not self.compiling:
            return
        still: list[Compiling] = []
        overran = False
        for fut, copies, t0 in self.compiling:
            if all(r.finished for r in copies):  # aborted while compiling
                self.grammars().forget(fut)
                continue
            error, again = self._compiled(fut, copies)
            if again is not None:
                still.append((again, copies, t0))
            elif error is not None:
                overran |= error.overran
                for r in copies:
                    if not r.finished:
                        r.finish_reason = FinishReason.REJECTED
                        r.error = error.message
        self.compiling = self._move_off_stuck_thread(still) if overran else still

    def _compiled(self, fut: concurrent.futures.Future[Any],
                  copies: list[Req]) -> tuple[_Refusal | None, concurrent.futures.Future[Any] | None]:
        """One compile's outcome: (why the copies are refused, or the future to keep waiting on)."""
        grammars = self.grammars()
        spec = copies[0].params.grammar
        assert spec is not None
        if fut.done():
            grammars.forget(fut)
        if fut.cancelled():  # its thread was abandoned (another compile overran): again
            return None, grammars.submit(spec)
        if not fut.done():
            if not grammars.overran(fut):
                return None, fut
            grammars.forget(fut)
            return _Refusal(grammars.timeout_message(spec), overran=True), None
        try:
            compiled = fut.result()
        except GrammarError as e:
            return _Refusal(str(e)), None
        self._start_matching(copies, grammars.matcher, compiled)
        return None, None

    def _start_matching(self, copies: list[Req], matcher: Callable[[Any], Any], compiled: Any) -> None:
        """Give each copy its matcher (a continuation's resumed output fed through it) and queue it."""
        for r in copies:
            r.matcher = matcher(compiled)
            refused = advance(r)
            if refused is not None:
                r.finish_reason = FinishReason.REJECTED
                r.error = refused
            del self.reqs[r.rid]
        self.enqueue([r for r in copies if not r.finished])
        for r in copies:
            if r.finished:
                self.reqs[r.rid] = r  # reported by the next step

    def _move_off_stuck_thread(self, still: list[Compiling]) -> list[Compiling]:
        """A compile overran: the others are queued behind it on its thread, so move them."""
        grammars = self.grammars()
        grammars.abandon()
        moved = []
        for f, c, t in still:
            g = c[0].params.grammar
            assert g is not None
            moved.append((f if f.done() else grammars.submit(g), c, t))
        return moved

    # ------------------------------------------------------------------ prompt logprobs
    def score_prompts(self) -> None:
        """Compute the prompt logprobs of the oldest waiting group (one per step, so a long
        prompt delays the running requests by one prefill at most), then queue it."""
        while self.scoring:
            live = [r for r in self.scoring[0] if not r.finished]
            if not live:  # aborted while waiting: step() reports it
                self.scoring.pop(0)
                continue
            if not self.score(live[0]):
                return  # no scratch KV yet: try again next step, keeping the order
            self.scoring.pop(0)
            for r in live[1:]:
                r.prompt_logprobs = live[0].prompt_logprobs
            self.enqueue(live)
            return


class _Refusal:
    __slots__ = ("message", "overran")

    def __init__(self, message: str, overran: bool = False) -> None:
        self.message = message
        self.overran = overran


def advance(req: Req) -> str | None:
    """Feed a continued copy's resumed output to its fresh grammar matcher (the invariant: a
    matcher has accepted exactly ``output_ids``); why not, if the grammar refuses it."""
    for k, t in enumerate(req.output_ids):
        if not req.matcher.accept_token(t):
            return (f"the continuation's token {t} at output position {k} does not follow the request's "
                    "output constraint")
    if req.output_ids and req.matcher.is_terminated():
        return "the continuation's output already completes the request's output constraint: it had finished"
    return None
