"""``Engine``: one model on one device, and the loop that ties scheduler, model runner and sampler.

One ``step()`` = schedule → forward → sample → commit. The parts live in small managers: the
``Admission`` (validation, grammar compiles, prompt scoring), the ``Scheduler`` (what runs next,
over the radix cache), the ``ModelRunner`` (batch building and the forward pass), the ``Sampler``
and the ``Speculator`` (drafts attached to decodes and verified in the same pass). ``builder``
makes them from an ``EngineConfig`` and hands each to the constructors that use it; the offline
API (``generate``, ``stream``) is ``OfflineAPI``. The engine process (``engine/process.py``) drives
the same ``step()`` and reports ``snapshot()``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tripod.config import EngineConfig
from tripod.engine import builder
from tripod.engine.admission import Admission, ImagePrompt, Prompt
from tripod.engine.offline import OfflineAPI
from tripod.engine.overlap import Lookahead
from tripod.engine.prompt_logprobs import score_prompt
from tripod.engine.request import (
    FinishReason,
    Req,
    Resume,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)
from tripod.engine.sampler import Drawn, SampleResult
from tripod.engine.scheduler import ScheduledItem, SchedulePolicy, Scheduler
from tripod.engine.speculative.counts import SpecCounts
from tripod.engine.speculative.speculator import Speculator
from tripod.engine.structured import GrammarBackend
from tripod.loader import LoadedModel
from tripod.memory.kv_blocks import TierLayout, pool_layout
from tripod.memory.kv_transfer import export_hybrid, export_prefix
from tripod.memory.prefix_cache import keyed_with_images
from tripod.memory.state_snapshots import state_stats
from tripod.memory.tiered_cache import TieredCache
from tripod.protocol.multimodal import ImageInput, ImageSpan
from tripod.protocol.stats import ComputeCard, EngineStats, SpecDecodeCounts, StepTimes

__all__ = ["Engine", "ImagePrompt", "Prompt", "StepCounters", "StepOutput"]


@dataclass(slots=True)
class StepCounters:
    """The engine's own cumulative counters, kept by its loop (``Engine.snapshot()`` reports them,
    with the queues and the KV, as the protocol's ``EngineStats``)."""

    steps: int = 0
    forward_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    forward_seconds: float = 0.0  # build + forward + sample (the whole numeric part of a step)
    # Where a step's time goes (seconds), for the served-workload profile
    # (benchmarks/serve_profile.py): scheduling, building the batch's tensors, the model's
    # forward pass (split by whether the step carried prefill tokens), sampling (grammar masks
    # included), and the bookkeeping after it.
    schedule_seconds: float = 0.0
    prepare_seconds: float = 0.0
    decode_forward_seconds: float = 0.0
    prefill_forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0
    prefill_tokens: int = 0  # tokens computed in prefill chunks (not decodes, not verifies)
    propose_seconds: float = 0.0  # speculative proposals (draft-model passes included)
    # Speculative decoding per proposer ("ngram", "draft", "self", "mtp", "jump_forward").
    spec: dict[str, SpecCounts] = field(default_factory=dict)

    @property
    def jump_forward_proposed(self) -> int:
        """Grammar-forced draft tokens sent for verification."""
        c = self.spec.get("jump_forward")
        return c.draft_tokens if c else 0

    @property
    def jump_forward_accepted(self) -> int:
        """Of those, tokens the model itself chose (= forward passes saved)."""
        c = self.spec.get("jump_forward")
        return c.accepted_tokens if c else 0


@dataclass(slots=True)
class _Verify:
    """The rows of a step's logits that verify drafts (all of them kept apart from the sampled rows)."""

    logits: torch.Tensor | None = None
    row: dict[int, int] = field(default_factory=dict)  # id(req) -> its first row


class Engine(OfflineAPI):
    """One model on one device. Not thread-safe: drive it from one thread (or one process)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu", *,
                 config: EngineConfig | None = None, loaded: LoadedModel | None = None, **overrides: Any) -> None:
        self.config = config = builder.resolve_config(config, model, dtype, device, overrides, loaded)
        t0 = time.monotonic()
        parts = builder.build(config, loaded)
        self.config = config = builder.without_jump_forward(config, parts)
        self.device, self.dtype, self.loaded, self.draft = parts.device, parts.dtype, parts.loaded, parts.draft
        self.model_config, self.tokenizer = parts.loaded.config, parts.loaded.tokenizer
        self.pool, self.kv_bytes_per_token, self.context_len = parts.pool, parts.kv_bytes_per_token, parts.context_len
        self.runner, self.sampler, self.eos_ids, self._threads = parts.runner, parts.sampler, parts.eos_ids, parts.threads
        self.group, self.ranks = parts.group, parts.ranks  # tensor parallel: the other ranks, what each holds
        self.cache, self.loras = parts.cache, parts.loras  # (loras None: this model/layout serves no adapters)
        self.vision, self.states = parts.vision, parts.states  # a VLM's images; a hybrid's recurrent states
        self.scheduler = Scheduler(self.pool.allocator, self.cache, max_running=config.max_running,
                                   max_batch_tokens=config.max_batch_tokens, chunk_size=config.chunk_size,
                                   policy=SchedulePolicy(config.policy, config.aging), loras=self.loras,
                                   states=self.states, snapshots=parts.snapshots)
        self.stats = StepCounters()
        self.spec = Speculator(lambda: self.config, self.tokenizer, self.pool.allocator, self.sampler,
                               self.stats.spec, parts.proposer)
        self._grammars: GrammarBackend | None = None
        self.admission = Admission(
            tokenizer=self.tokenizer, vocab_size=self.model_config.vocab_size, eos_ids=self.eos_ids,
            max_len=lambda: self.max_request_len, cache=self.cache, scheduler=self.scheduler,
            count_prompt=self._count_prompt, score=self._score, grammars=lambda: self.grammars, loras=self.loras,
            images=self.vision.prepare, hold=self.vision.hold, routing=self.runner.routing_refusal)
        self.lookahead = (Lookahead(self.scheduler, self.runner, self._drafts_possible)
                          if builder.overlaps(config, self.runner) else None)  # engine/overlap.py
        self.inboxes: dict[str, list[StepOutput]] = {}  # rid -> undelivered stream outputs
        self._kv_layout: TierLayout | None = None  # the KV block layout, made on first use
        self._closed = False
        builder.log_started(config, parts, time.monotonic() - t0)

    # ------------------------------------------------------------------ describing
    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def max_request_len(self) -> int:
        """The longest a request (prompt + output) may grow: the context, or the KV pool."""
        return min(self.context_len, self.pool.num_slots)

    @property
    def grammars(self) -> GrammarBackend:
        """The structured-outputs backend, created on first use (XGrammar loads lazily)."""
        if self._grammars is None:
            self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_ids,
                                            device_kernel=self.runner.triton)
        return self._grammars

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    resume: Sequence[Resume] | None = None, *, tenant: str = "", weight: float = 1.0,
                    images: Sequence[ImageInput] = ()) -> list[Req]:
        """Queue a prompt; returns its ``params.n`` copies (ids ``{id}`` or ``{id}-{i}``).

        ``tenant``/``weight``: the fair share it is scheduled under (``engine/fairness.py``).

        ``images``: a vision-language model's images, each filling its span of the prompt's
        placeholder tokens (``loader.multimodal.VisionProcessor.expand`` makes both); checked here
        (``ValueError`` saying what is wrong).

        ``resume``: continue only the copies named, each from the tokens it had generated (see
        ``Resume``); the copies keep their ids and indices.

        A constrained request (``params.grammar``) waits while its grammar compiles in the
        background; an invalid grammar (or a resumed output it refuses) finishes it as
        ``rejected`` with ``Req.error`` set.
        """
        copies = self.admission.prepare(prompt, params, request_id, resume, tenant=tenant, weight=weight, images=images)
        self.admission.admit(copies)  # (queued copies hold their images until reported finished: _deliver)
        return copies

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT LoRA adapter under ``name`` (checked against the base model now: a
        mismatch raises ``ValueError`` saying what); requests pick it with ``SamplingParams(lora=name)``."""
        if self.loras is None:
            raise ValueError(f"{self.model_config.architecture} in this layout serves no LoRA adapters")
        self.loras.register(name, path)

    def unload_lora(self, name: str) -> int:
        """Refuse new requests for ``name`` from now on; returns how many running ones still hold it
        (they finish on its weights)."""
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters")
        self.loras.unregister(name)
        return self.loras.in_use(name)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every copy when n > 1). Its KV is released at once."""
        hit = [r for r in self.admission.reqs.values() if r.rid == request_id or r.group == request_id]
        for r in hit:
            self.scheduler.abort(r)
        return bool(hit)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.admission.busy

    @property
    def pending(self) -> bool:
        """Requests not yet reported finished by ``step()`` (queued, running, or just aborted)."""
        return bool(self.admission.reqs)

    def _count_prompt(self, tokens: int) -> None:
        self.stats.prompt_tokens += tokens

    def _score(self, req: Req) -> bool:
        lora = self.loras.weights(req.lora) if req.lora is not None and self.loras is not None else None
        return score_prompt(req, self.runner, self.pool.allocator, self.cache, self.config.chunk_size, lora)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one forward pass for whatever the scheduler picks; report what changed."""
        t_start = time.perf_counter()
        self._threads.restore_when_built()
        self.admission.poll()
        outs = self._finished_while_queued()
        ahead = self.lookahead.take() if self.lookahead is not None else None
        items = ahead.items if ahead is not None else self.scheduler.schedule()
        verifying = self._attach_drafts(items)
        assert ahead is None or not verifying, "drafts on a step laid out ahead"
        if not items:
            if not outs:
                self.admission.wait_idle()
            return self._deliver(outs)
        t0 = time.perf_counter()
        self.stats.schedule_seconds += t0 - t_start
        batch, sampling = (ahead.batch, ahead.sampling) if ahead is not None else self.runner.build_batch(items)
        t1 = time.perf_counter()
        logits = self.runner.run(batch)
        self.spec.after_forward(batch, self.runner.model.last_hidden)
        t2 = time.perf_counter()
        self._count_forward(items, t0, t1, t2)
        logits, sampling, verify = self._split_verify(logits, sampling, verifying)
        drawn = self._draw(logits, sampling)
        if self.lookahead is not None and drawn is not None and not verifying:
            t = time.perf_counter()
            self.lookahead.prepare(items, sampling, drawn.tokens)  # while the device computes this step
            self.stats.prepare_seconds += time.perf_counter() - t
        result = self.sampler.resolve(drawn) if drawn is not None else None
        t3 = time.perf_counter()
        self._count_sampled(items, t0, t2, t3)
        outs += self._commit(items, sampling, logits, result, verify)
        self.stats.bookkeeping_seconds += time.perf_counter() - t3
        return self._deliver(outs)

    def report_finished(self) -> list[StepOutput]:
        """The requests that finished without a step (aborted), for a loop paused in place."""
        return self._deliver(self._finished_while_queued())

    # ------------------------------------------------------------------ step parts
    def _finished_while_queued(self) -> list[StepOutput]:
        """Requests aborted (or rejected) before they ran have finished without a step: report them once."""
        outs = [StepOutput(r, [], [], True) for r in self.admission.reqs.values() if r.finished]
        for o in outs:
            del self.admission.reqs[o.req.rid]
        return outs

    def _attach_drafts(self, items: list[ScheduledItem]) -> list[ScheduledItem]:
        """Drafts (grammar-forced text, n-gram lookups, a draft model's guesses) ride on decode
        items, to be verified in this step's forward pass (see engine/speculative)."""
        t = time.perf_counter()
        verifying = self.spec.attach(items, self.config.max_batch_tokens - sum(it.length for it in items))
        self.stats.propose_seconds += time.perf_counter() - t
        return verifying

    def _count_forward(self, items: list[ScheduledItem], t0: float, t1: float, t2: float) -> None:
        st = self.stats
        st.prepare_seconds += t1 - t0
        chunk_tokens = sum(it.length for it in items if it.length > 1 and not it.verify)
        if chunk_tokens:
            st.prefill_forward_seconds += t2 - t1
            st.prefill_tokens += chunk_tokens
        else:
            st.decode_forward_seconds += t2 - t1
        self.spec.observe_step(sum(it.length for it in items), t2 - t1, decode_only=not chunk_tokens)

    def _count_sampled(self, items: list[ScheduledItem], t0: float, t2: float, t3: float) -> None:
        st = self.stats
        st.sample_seconds += t3 - t2
        st.forward_seconds += t3 - t0
        st.steps += 1
        st.forward_tokens += sum(it.length for it in items)

    @staticmethod
    def _split_verify(logits: torch.Tensor, sampling: list[ScheduledItem],
                      verifying: list[ScheduledItem]) -> tuple[torch.Tensor, list[ScheduledItem], _Verify]:
        """Set the verifying items' rows apart from the rows sampled one token each."""
        if not verifying:
            return logits, sampling, _Verify()
        for it in verifying:  # the drafts were in all_ids for the forward only
            del it.req.output_ids[len(it.req.output_ids) - len(it.req.draft) :]
        rows, off = [], 0
        for it in sampling:
            rows.append(off)
            off += it.length if it.verify else 1
        verify = _Verify(logits, {id(it.req): rows[j] for j, it in enumerate(sampling) if it.verify})
        keep = [rows[j] for j, it in enumerate(sampling) if not it.verify]
        return logits[keep], [it for it in sampling if not it.verify], verify

    def _draw(self, logits: torch.Tensor, sampling: list[ScheduledItem]) -> Drawn | None:
        reqs = [it.req for it in sampling]
        if any(r.matcher is not None for r in reqs):
            self.grammars.apply_masks(logits, [r.matcher for r in reqs])
        return self.sampler.sample_on_device(logits, reqs) if reqs else None

    def _drafts_possible(self, req: Req) -> bool:
        """Whether ``req`` may carry drafts in a step (so its next step cannot be laid out ahead)."""
        return self.spec.proposer is not None or (req.matcher is not None and self.config.jump_forward)

    # ------------------------------------------------------------------ commit
    def _commit(self, items: list[ScheduledItem], sampling: list[ScheduledItem], logits: torch.Tensor,
                result: SampleResult | None, verify: _Verify) -> list[StepOutput]:
        """Apply the step to each request: verified drafts, a sampled token, or a prefill chunk done."""
        outs: list[StepOutput] = []
        sampled_at = {id(it.req): j for j, it in enumerate(sampling)}
        for it in items:
            req = it.req
            if it.verify:
                outs.append(self._commit_verified(it, verify))
                continue
            req.computed += it.length
            j = sampled_at.get(id(req))
            if j is None:
                self.scheduler.cache_prefix(req)  # a prefill chunk: share it right away
                continue
            assert result is not None
            outs.append(self._commit_token(req, result.token_ids[j], result.logprobs[j], logits[j]))
        for o in outs:
            if o.finished:
                self.admission.reqs.pop(o.req.rid, None)
        return outs

    def _commit_verified(self, it: ScheduledItem, verify: _Verify) -> StepOutput:
        req = it.req
        r0 = verify.row[id(req)]
        assert verify.logits is not None
        v = self.spec.verify(it, verify.logits[r0 : r0 + it.length], self._mask_row, self._stop_reason)
        self.stats.generated_tokens += len(v.tokens)
        if v.reason is not None:
            self._finish(req, v.reason)
        return StepOutput(req, v.tokens, v.logprobs, req.finished)

    def _commit_token(self, req: Req, tok: int, lp: TokenLogprob | None, row: torch.Tensor) -> StepOutput:
        if req.first_token_time is None:  # (a continuation's prompt includes its resumed output)
            self.scheduler.cache_prefix(req)  # the whole prompt is computed: share it
            req.first_token_time = time.monotonic()
            self.stats.cached_prompt_tokens += req.cached_tokens
        if req.matcher is not None and not req.matcher.accept_token(tok):
            # NOTE: only possible when the grammar allowed no token at all (what it requires
            # next cannot be written with this vocabulary): the caller's constraint, a 400.
            assert not torch.isfinite(row).any(), f"{req.rid}: the grammar refused sampled token {tok}"
            req.error = unsatisfiable(req)
            self._finish(req, FinishReason.REJECTED)
            return StepOutput(req, [], [], True)
        req.output_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        self.stats.generated_tokens += 1
        reason = self._stop_reason(req, tok)
        if reason is not None:
            self._finish(req, reason)
        return StepOutput(req, [tok], [lp] if lp is not None else [], req.finished)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        req.finish_time = time.monotonic()

    def _mask_row(self, row: torch.Tensor, matcher: Any) -> None:
        self.grammars.apply_masks(row, [matcher])

    @staticmethod
    def _stop_reason(req: Req, tok: int) -> FinishReason | None:
        p = req.params
        if req.matcher is not None and req.matcher.is_terminated():
            return FinishReason.STOP  # the grammar is complete and its stop token was sampled
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_ids):
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_tokens or req.seq_len >= req.max_len:
            return FinishReason.LENGTH
        return None

    def _deliver(self, outs: list[StepOutput]) -> list[StepOutput]:
        """File each output in its stream's inbox (if one is listening); free idle memory."""
        for o in outs:
            r = o.req
            if o.finished and r.images is not None:
                self.vision.release(r)
            if r.prompt_logprobs is not None and not r.prompt_logprobs_reported:
                o.prompt_logprobs = r.prompt_logprobs
                r.prompt_logprobs_reported = True
            box = self.inboxes.get(o.req.rid)
            if box is not None:
                box.append(o)
        if not self.scheduler.running and self.runner.mirror is not None:
            self.runner.mirror.drop()  # idle: give the dense decode rows back
        return outs

    # ------------------------------------------------------------------ the group
    def check_workers(self) -> None:
        """Raise ``WorkerLost`` if a rank of the group has exited or stopped answering (the engine
        cannot go on)."""
        if self.group is not None:
            self.group.watch()

    def close(self) -> None:
        """Close the prefix cache (``--kv-disk``: the tree saved to the disk tier, where a restart
        finds it) and stop the tensor-parallel workers. Idempotent."""
        if not self._closed:
            self._closed = True
            if self.lookahead is not None:
                self.lookahead.discard()  # its reserved slots back before the tree is saved
            self.cache.close()
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ KV transfer
    @property
    def kv_layout(self) -> TierLayout:
        """The block layout of this engine's KV (the disk tier's, when there is one; its identity
        digested from the weights once, on first use)."""
        if self._kv_layout is None:
            cache = self.cache
            self._kv_layout = cache.layout if isinstance(cache, TieredCache) else pool_layout(
                self.pool, builder.kv_identity(self.config, self.loaded, self.dtype, self.pool),
                state_bytes=self.states.bytes_per_slot if self.states is not None else 0)
        return self._kv_layout

    def export_kv(self, tokens: list[int], images: Sequence[ImageSpan] = ()) -> list[bytes]:
        """The whole blocks of ``tokens`` the prefix cache holds, as disk-tier block bytes (a prefill replica's
        hand-over; ``memory/kv_transfer.py``). ``images``: the prompt's images' spans (keyed by content)."""
        if self.group is not None:
            raise ValueError("a model over several processes holds its KV in shards: it cannot export it")
        key = keyed_with_images(tokens, [(im.hash, im.offset, im.length) for im in images]) if images else tokens
        if self.states is not None:  # (a hybrid's: up to its deepest state snapshot, which travels too)
            return export_hybrid(self.cache, self.pool, self.kv_layout, self.scheduler.snapshots, key)
        return export_prefix(self.cache, self.pool, self.kv_layout, key)

    # ------------------------------------------------------------------ reporting
    def snapshot(self, *, check: bool = False) -> EngineStats:
        """The engine's state and counters as the protocol's snapshot (what the engine process
        sends in every heartbeat). ``check``: also prove the KV ownership invariant, when no request
        holds memory (``consistent``; None while requests run)."""
        s, st, cache = self.scheduler, self.stats, self.cache
        out = EngineStats(
            running=len(s.running), waiting=len(s.waiting), kv_slots=self.pool.allocator.num_slots,
            kv_free=self.pool.allocator.num_free, kv_cached=cache.total_size, kv_pinned=cache.protected_size,
            prefix_hit_tokens=cache.stats.hit_tokens, prefix_query_tokens=cache.stats.query_tokens,
            generated_tokens=st.generated_tokens, prompt_tokens=st.prompt_tokens, steps=st.steps,
            retractions=s.num_retractions, jump_forward_proposed=st.jump_forward_proposed,
            jump_forward_accepted=st.jump_forward_accepted, prefill_tokens=st.prefill_tokens,
            spec_decode={name: SpecDecodeCounts(c.drafts, c.draft_tokens, c.accepted_tokens)
                         for name, c in st.spec.items()}, weight_bytes=builder.resident_weight_bytes(self.runner.model),
            compute=self.runner.describe(), compute_card=ComputeCard(**self.runner.card()),
            time=StepTimes(schedule=st.schedule_seconds, prepare=st.prepare_seconds,
                           decode_forward=st.decode_forward_seconds, prefill_forward=st.prefill_forward_seconds,
                           sample=st.sample_seconds, bookkeeping=st.bookkeeping_seconds),
        )
        if isinstance(cache, TieredCache):
            out.kv_disk = cache.report()
        if self.vision.enabled:
            out.vision = self.vision.stats()
        if self.states is not None:
            out.states = state_stats(self.states, self.scheduler.snapshots)
        if check:
            out.consistent = None  # NOTE: provable only when no request holds memory (aborted ones hold none)
            if not self.has_work:
                try:
                    self.assert_consistent()
                    out.consistent = True
                except AssertionError as err:
                    out.consistent = False
                    out.inconsistency = str(err)
        return out

    # ------------------------------------------------------------------ checks
    def assert_consistent(self) -> None:
        """KV ownership invariant (see ``Scheduler.assert_consistent``); with no request, no image
        features held either (``VisionInputs.assert_idle``)."""
        self.scheduler.assert_consistent()
        if not self.has_work and not self.admission.reqs:
            self.vision.assert_idle()

    def reset_prefix_cache(self) -> None:
        self.cache.reset()


def unsatisfiable(req: Req) -> str:
    return (f"the output constraint allows no token at output position {len(req.output_ids)}: what it requires "
            "next cannot be written with this model's vocabulary; change the constraint")
