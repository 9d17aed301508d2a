"""The engine's offline API: ``generate`` (batched, to completion), ``stream`` (deltas as they come)
and the text helpers (encode, chat template, decode). ``Engine`` inherits it; everything here drives
``Engine.step`` and reads what it files (``inboxes``), through ``OfflineHost``: what of the engine this
API may use (so this module needs nothing of ``engine.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from tripod.detokenizer import IncrementalDetokenizer
from tripod.engine.admission import Admission, ImagePrompt, Prompt, encode_prompt
from tripod.engine.request import (
    Req,
    RequestOutput,
    Resume,
    SamplingParams,
    StepOutput,
    StreamDelta,
)
from tripod.engine.routed_experts import finished_routing
from tripod.engine.scheduler import Scheduler
from tripod.engine.structured import GrammarBackend
from tripod.engine.vision import VisionInputs
from tripod.loader import LoadedModel
from tripod.models.config import ModelConfig


class OfflineHost(Protocol):
    """What the offline API uses of the engine it is mixed into (``engine.Engine``)."""

    tokenizer: Any
    model_config: ModelConfig
    admission: Admission
    scheduler: Scheduler
    inboxes: dict[str, list[StepOutput]]

    @property
    def grammars(self) -> GrammarBackend: ...

    @property
    def has_work(self) -> bool: ...

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    resume: Sequence[Resume] | None = None, *, tenant: str = "", weight: float = 1.0,
                    images: Sequence[Any] = ()) -> list[Req]: ...

    loaded: LoadedModel
    vision: VisionInputs

    def step(self) -> list[StepOutput]: ...

    def decode(self, ids: list[int]) -> str: ...

    def _output(self, r: Req) -> RequestOutput: ...


class OfflineAPI:
    """``generate`` / ``stream`` / text helpers over an engine's loop (mixed into ``Engine``)."""

    # ------------------------------------------------------------------ text helpers
    def encode(self: OfflineHost, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def apply_chat_template(self: OfflineHost, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self: OfflineHost, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def image_prompt(self: OfflineHost, messages: list[dict[str, Any]], images: Sequence[Any],
                     detail: Sequence[str | None] | None = None, add_generation_prompt: bool = True) -> ImagePrompt:
        """Chat ``messages`` whose content parts include ``{"type": "image"}`` (one per image, in
        order), rendered through the checkpoint's own chat template and processor with ``images``
        (PIL images): a prompt ``generate`` and ``stream`` take. ``ValueError`` on a text-only model."""
        proc = self.vision.processor(self.loaded.path)
        if proc is None:
            raise ValueError(f"{self.model_config.architecture} takes text only: it has no image processor")
        ids, inputs = proc.expand(proc.render(messages, add_generation_prompt), list(images), detail)
        return ImagePrompt(ids, inputs)

    # ------------------------------------------------------------------ generate
    def generate(
        self: OfflineHost,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched. One output per prompt (``n`` per prompt
        when ``n`` > 1, copies adjacent), in input order."""
        plist, params_list = _pair(prompts, params)
        # Validate every prompt before queueing any: a bad one must not orphan the others.
        groups = [self.admission.prepare(p, sp, None) for p, sp in zip(plist, params_list, strict=True)]
        rids = [r.rid for g in groups for r in g]
        if len(set(rids)) != len(rids):
            raise ValueError("duplicate request ids")
        for g in groups:  # grammars compile here, so an invalid one raises before anything runs
            spec = g[0].params.grammar
            if spec is not None:
                compiled = self.grammars.compile_now(spec)
                for r in g:
                    r.matcher = self.grammars.matcher(compiled)
                    assert not r.output_ids
        for g in groups:
            self.admission.enqueue(g)
        while any(not r.finished for g in groups for r in g):
            self.step()
        for rid in rids:
            self.admission.reqs.pop(rid, None)
        return [self._output(r) for g in groups for r in g]

    def _output(self: OfflineHost, r: Req) -> RequestOutput:
        return RequestOutput(
            request_id=r.rid,
            prompt_token_ids=r.prompt_ids,
            token_ids=list(r.output_ids),
            text=self.decode(r.output_ids),
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            cached_tokens=r.cached_tokens,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            index=r.index,
            error=r.error,
            prompt_logprobs=r.prompt_logprobs,
            routed_experts=finished_routing(r),
        )

    # ------------------------------------------------------------------ stream
    def stream(self: OfflineHost, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield deltas (new tokens and text) for one prompt as they are generated.

        Other queued requests progress too. Closing the iterator early aborts the request.
        """
        copies = self.add_request(prompt, params)
        detok = {r.rid: IncrementalDetokenizer(self.tokenizer) for r in copies}
        mine = {r.rid: r for r in copies}
        # NOTE: another stream (or generate) may run the step that produces our tokens, so
        # step() files them here and each stream drains only its own.
        inbox: list[StepOutput] = []
        for rid in mine:
            self.inboxes[rid] = inbox
        done: set[str] = set()
        try:
            while len(done) < len(copies):
                if not inbox:
                    self.step()
                    # NOTE: an unfinished request is always queued or running, so an idle
                    # engine with nothing delivered would be a lost request: fail, never spin.
                    assert inbox or self.has_work, f"stream lost its requests: {list(mine)}"
                batch, inbox[:] = list(inbox), []
                for o in batch:
                    if o.req.rid not in done:
                        yield _delta(o, detok[o.req.rid], done)
        finally:
            for rid, r in mine.items():
                self.inboxes.pop(rid, None)
                if not r.finished:
                    self.scheduler.abort(r)
                    self.admission.reqs.pop(rid, None)


def _pair(prompts: Prompt | Sequence[Prompt],
          params: SamplingParams | Sequence[SamplingParams] | None) -> tuple[list[Prompt], list[SamplingParams]]:
    """One prompt or many, with one SamplingParams for all or one each."""
    plist: list[Prompt]
    if isinstance(prompts, str | ImagePrompt) or (prompts and isinstance(prompts[0], int)):
        plist = [prompts]  # type: ignore[list-item]  # one prompt (text or token ids)
    else:
        plist = list(prompts)  # type: ignore[arg-type]
    if params is None or isinstance(params, SamplingParams):
        return plist, [params or SamplingParams()] * len(plist)
    params_list = list(params)
    if len(params_list) != len(plist):
        raise ValueError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
    return plist, params_list


def _delta(o: StepOutput, detok: IncrementalDetokenizer, done: set[str]) -> StreamDelta:
    r = o.req
    text = detok.push(o.new_token_ids)
    if o.finished:
        text += detok.flush()
        done.add(r.rid)
    return StreamDelta(
        request_id=r.rid,
        index=r.index,
        token_ids=o.new_token_ids,
        text=text,
        finish_reason=r.finish_reason.value if o.finished and r.finish_reason else None,
        cached_tokens=r.cached_tokens,
        logprobs=o.new_logprobs or None,
        error=r.error,
        prompt_logprobs=o.prompt_logprobs,
    )
