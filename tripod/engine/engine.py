"""``Engine``: the offline API, and the loop that ties scheduler, model runner and sampler.

One ``step()`` = schedule → forward → sample → bookkeeping. ``generate`` and ``stream`` drive
steps until their requests finish; the server's engine process drives the same ``step()``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tripod import kernels
from tripod.config import EngineConfig
from tripod.engine.detokenizer import IncrementalDetokenizer
from tripod.engine.model_runner import ModelRunner
from tripod.engine.prompt_logprobs import score_prompt
from tripod.engine.radix_cache import RadixCache
from tripod.engine.request import (
    FinishReason,
    Req,
    RequestOutput,
    Resume,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
)
from tripod.engine.sampler import Sampler, noise_key
from tripod.engine.scheduler import SchedulePolicy, Scheduler
from tripod.engine.speculative.counts import SpecCounts
from tripod.engine.speculative.factory import extra_bytes_per_token, load_draft, make_proposer
from tripod.engine.speculative.speculator import Speculator
from tripod.engine.structured import GrammarBackend, GrammarError
from tripod.loader import LoadedModel, load_model
from tripod.memory.kv_pool import slots_from_budget

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request."""

    req: Req
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    # params.prompt_logprobs: set on the request's first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class EngineStats:
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


class Engine:
    """One model on one device. Not thread-safe: drive it from one thread (or one process)."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        *,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        **overrides: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(model=model, dtype=dtype, device=device, **overrides)
        else:
            # Explicit arguments win over the given config.
            if model is not None:
                overrides["model"] = model
            if dtype != "auto":
                overrides["dtype"] = dtype
            if device != "cpu":
                overrides["device"] = device
            if overrides:
                config = replace(config, **overrides)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        t0 = time.monotonic()
        if loaded is not None and config.weights != "dequantized" and loaded.weights != config.weights:
            if config.weights == "fp8":
                raise ValueError("--weights fp8 needs the model loaded with its FP8 weights (load_model(..., weights='fp8'))")
            raise ValueError("--weights stored needs the model loaded with its stored weights (load_model(..., weights='stored'))")
        self.loaded = loaded or load_model(config.model, self.dtype, self.device, weights=config.weights)
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        per_token = mc.pool_spec().bytes_per_token(self.dtype)
        self.draft = load_draft(config, self.loaded, self.dtype, self.device)
        per_token += extra_bytes_per_token(config, self.loaded, self.dtype)
        if self.draft is not None:
            dc = self.draft.config
            # NOTE: the draft's K/V live at the target's slot ids: one token slot costs both.
            per_token += dc.pool_spec().bytes_per_token(self.dtype)
        num_slots = slots_from_budget(
            kv_cache_tokens=config.kv_cache_tokens,
            kv_mem_fraction=config.kv_mem_fraction,
            bytes_per_token=per_token,
            device=self.device,
            max_tokens_cap=config.max_kv_cache_tokens,
        )
        self.pool = mc.pool_spec().make(num_slots, self.dtype, self.device)
        self.kv_bytes_per_token = mc.pool_spec().bytes_per_token(self.dtype)
        if mc.mla is not None:
            log.info("MLA latent KV: %d bytes per token (the same model with MHA: %d)", self.kv_bytes_per_token,
                     mc.mha_equivalent_spec().bytes_per_token(self.dtype))
        self.cache = RadixCache(self.pool.allocator, enabled=config.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.pool.allocator,
            self.cache,
            max_running=config.max_running,
            max_batch_tokens=config.max_batch_tokens,
            chunk_size=config.chunk_size,
            policy=SchedulePolicy(config.policy, config.aging),
        )
        self.context_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        path = config.compute_path(self.dtype)
        level = config.kernel_level
        if level is not None:
            why = kernels.unavailable_reason(level)
            if why is not None:
                raise ValueError(f"--kernels {level} cannot run here: {why}; use --kernels optimized (the best level "
                                 f"this CPU supports: {kernels.best_level() or 'none'}) or eager")
        if path == "optimized" and self.device.type == "cpu":
            # "optimized", a level or stored weights asked for explicitly: wait for the kernels'
            # build (tests, benchmarks); under "auto" serve on torch's ops while it builds in
            # the background, and switch when it is loaded.
            kernels.load(level, wait=config.kernels != "auto" or config.weights == "stored")
        # NOTE: while the kernels build in the background the compiler holds a core; a
        # parallel region whose thread shares that core waits for it at every barrier (10x
        # slower steps on 2 cores), so serve on one thread fewer until the build ends.
        self._threads_after_build: int | None = None
        if kernels.building() and torch.get_num_threads() > 1:
            self._threads_after_build = torch.get_num_threads()
            torch.set_num_threads(self._threads_after_build - 1)
        self.runner = ModelRunner(
            self.loaded.model, self.pool, self.device, use_mirror=config.decode_mirror,
            path=path, max_len=self.max_request_len, stored=config.weights == "stored", level=level,
        )
        if config.weights == "stored" and self.runner.kernel_reason is not None:
            raise ValueError(f"--weights stored needs tripod's CPU kernels, which cannot run here: {self.runner.kernel_reason}")
        self.sampler = Sampler(self.device, config.seed)
        self.stats = EngineStats()
        self.spec = Speculator(
            lambda: self.config, self.tokenizer, self.pool.allocator, self.sampler, self.stats.spec,
            make_proposer(config, self.loaded, self.draft, self.pool, self.sampler, path=path,
                          max_len=self.max_request_len, device=self.device, dtype=self.dtype),
        )
        eos = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)
        self._reqs: dict[str, Req] = {}
        self._inboxes: dict[str, list[StepOutput]] = {}  # rid -> undelivered stream outputs
        self._rid_counter = itertools.count()
        self._grammars: GrammarBackend | None = None
        # Requests whose grammar is compiling off the loop: (future, copies, submitted at).
        self._compiling: list[tuple[concurrent.futures.Future[Any], list[Req], float]] = []
        # Requests waiting for their prompt logprobs (params.prompt_logprobs), in arrival order.
        self._scoring: list[list[Req]] = []
        log.info(
            "tripod engine: model=%s (%s, stored as %s, weights %s) dtype=%s device=%s kv_slots=%d (%.0f MiB) "
            "context=%d compute=%s speculative=%s loaded in %.1fs",
            self.loaded.name,
            mc.architecture,
            self.loaded.quantization,
            {"stored": "executed as stored", "fp8": "kept in FP8 (w8a16)"}.get(config.weights, "dequantized"),
            str(self.dtype).removeprefix("torch."),
            self.device,
            num_slots,
            num_slots * per_token / 2**20,
            self.context_len,
            self.runner.describe(),
            config.speculative or "off",
            time.monotonic() - t0,
        )

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

    # ------------------------------------------------------------------ text helpers
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        ids = list(prompt)
        if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size})")
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ requests
    @property
    def grammars(self) -> GrammarBackend:
        """The structured-outputs backend, created on first use (XGrammar loads lazily)."""
        if self._grammars is None:
            self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        return self._grammars

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        resume: Sequence[Resume] | None = None,
    ) -> list[Req]:
        """Queue a prompt; returns its ``params.n`` copies (ids ``{id}`` or ``{id}-{i}``).

        ``resume``: continue only the copies named, each from the tokens it had generated (see
        ``Resume``); the copies keep their ids and indices.

        A constrained request (``params.grammar``) waits while its grammar compiles in the
        background; an invalid grammar (or a resumed output it refuses) finishes it as
        ``rejected`` with ``Req.error`` set.
        """
        copies = self._prepare(prompt, params, request_id, resume)
        spec = copies[0].params.grammar
        if spec is None:
            self._enqueue(copies)
        else:
            for r in copies:
                self._reqs[r.rid] = r
            self._compiling.append((self.grammars.submit(spec), copies, time.monotonic()))
        return copies

    def _poll_compiles(self) -> None:
        """Queue the requests whose grammar is ready; reject those whose grammar failed."""
        if not self._compiling:
            return
        still: list[tuple[concurrent.futures.Future[Any], list[Req], float]] = []
        overran = False
        for fut, copies, t0 in self._compiling:
            if all(r.finished for r in copies):  # aborted while compiling
                self.grammars.forget(fut)
                continue
            spec = copies[0].params.grammar
            assert spec is not None
            error = None
            if fut.done():
                self.grammars.forget(fut)
            if fut.cancelled():  # its thread was abandoned (another compile overran): again
                still.append((self.grammars.submit(spec), copies, t0))
                continue
            if fut.done():
                try:
                    compiled = fut.result()
                except GrammarError as e:
                    error = str(e)
                else:
                    for r in copies:
                        r.matcher = self.grammars.matcher(compiled)
                        refused = _advance(r)
                        if refused is not None:
                            r.finish_reason = FinishReason.REJECTED
                            r.error = refused
                        del self._reqs[r.rid]
                    self._enqueue([r for r in copies if not r.finished])
                    for r in copies:
                        if r.finished:
                            self._reqs[r.rid] = r  # reported by the next step
                    continue
            elif self.grammars.overran(fut):
                error = self.grammars.timeout_message(spec)
                self.grammars.forget(fut)
                overran = True
            if error is None:
                still.append((fut, copies, t0))
                continue
            for r in copies:
                if not r.finished:
                    r.finish_reason = FinishReason.REJECTED
                    r.error = error
        if overran:
            # The others are queued behind the stuck compile on its thread: move them.
            self.grammars.abandon()
            moved = []
            for f, c, t in still:
                g = c[0].params.grammar
                assert g is not None
                moved.append((f if f.done() else self.grammars.submit(g), c, t))
            still = moved
        self._compiling = still

    def _prepare(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
        resume: Sequence[Resume] | None = None,
    ) -> list[Req]:
        """Validate a prompt and build its copies without queueing anything."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        limit = self.max_request_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context allows at most {limit - 1} "
                f"(context {limit} including at least one generated token); shorten the prompt"
            )
        base = request_id or f"req-{next(self._rid_counter)}"
        prior = {r.index: list(r.output_ids) for r in resume} if resume is not None else {}
        if resume is not None:
            self._check_resume(resume, params, ids, limit)
        copies: list[Req] = []
        for i in sorted(prior) if resume is not None else range(params.n):
            rid = base if params.n == 1 else f"{base}-{i}"
            if rid in self._reqs:
                raise ValueError(f"request id {rid!r} is already in use")
            req = Req(
                list(ids), params, rid=rid, eos_ids=self.eos_ids, max_len=limit,
                noise_key=noise_key(params.seed, i) if params.seed is not None else None,
                index=i, group=base, output_ids=prior.get(i, []),
            )
            if copies and self.cache.enabled:
                req.wait_for = copies[0]
            copies.append(req)
        return copies

    def _check_resume(self, resume: Sequence[Resume], params: SamplingParams, ids: list[int], limit: int) -> None:
        """A continuation names distinct copies of the request, each with fewer tokens than it may
        generate and none that would have ended it."""
        if not resume:
            raise ValueError("a continuation must resume at least one copy")
        seen: set[int] = set()
        vocab = self.model_config.vocab_size
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

    def _enqueue(self, copies: list[Req]) -> None:
        if copies and copies[0].params.prompt_logprobs is not None and copies[0].prompt_logprobs is None:
            for req in copies:
                self._reqs[req.rid] = req
            self._scoring.append(copies)  # queued once scored (_score_prompts)
            return
        for req in copies:
            self._reqs[req.rid] = req
            self.scheduler.add(req)
            self.stats.prompt_tokens += len(req.prompt_ids)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every copy when n > 1). Its KV is released at once."""
        hit = [r for r in self._reqs.values() if r.rid == request_id or r.group == request_id]
        for r in hit:
            self.scheduler.abort(r)
        return bool(hit)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling) or bool(self._scoring)

    @property
    def pending(self) -> bool:
        """Requests not yet reported finished by ``step()`` (queued, running, or just aborted)."""
        return bool(self._reqs)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one forward pass for whatever the scheduler picks; report what changed."""
        t_start = time.perf_counter()
        if self._threads_after_build is not None and not kernels.building():
            torch.set_num_threads(self._threads_after_build)  # the build is over
            self._threads_after_build = None
        self._poll_compiles()
        self._score_prompts()
        outs: list[StepOutput] = []
        # Requests aborted while queued have finished without a step; report them once.
        for r in list(self._reqs.values()):
            if r.finished:
                outs.append(StepOutput(r, [], [], True))
                del self._reqs[r.rid]
        items = self.scheduler.schedule()
        t_prop = time.perf_counter()
        verifying = self.spec.attach(items, self.config.max_batch_tokens - sum(it.length for it in items))
        self.stats.propose_seconds += time.perf_counter() - t_prop
        if not items:
            if self._compiling and not outs and not self._scoring:
                # Nothing to run but grammars compiling: wait a little for one, not spin.
                concurrent.futures.wait([f for f, _, _ in self._compiling], timeout=0.005,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return self._deliver(outs)
        t0 = time.perf_counter()
        st = self.stats
        st.schedule_seconds += t0 - t_start
        batch, sampling = self.runner.build_batch(items)
        t1 = time.perf_counter()
        logits = self.runner.run(batch)
        self.spec.after_forward(batch, self.runner.model.last_hidden)
        t2 = time.perf_counter()
        st.prepare_seconds += t1 - t0
        chunk_tokens = sum(it.length for it in items if it.length > 1 and not it.verify)
        if chunk_tokens:
            st.prefill_forward_seconds += t2 - t1
            st.prefill_tokens += chunk_tokens
        else:
            st.decode_forward_seconds += t2 - t1
        self.spec.observe_step(sum(it.length for it in items), t2 - t1, decode_only=not chunk_tokens)
        if verifying:
            for it in verifying:  # the drafts were in all_ids for the forward only
                del it.req.output_ids[len(it.req.output_ids) - len(it.req.draft) :]
            rows, off = [], 0
            for it in sampling:
                rows.append(off)
                off += it.length if it.verify else 1
            verify_rows = {id(it.req): rows[j] for j, it in enumerate(sampling) if it.verify}
            keep = [rows[j] for j, it in enumerate(sampling) if not it.verify]
            all_logits, logits = logits, logits[keep]
            sampling = [it for it in sampling if not it.verify]
        reqs = [it.req for it in sampling]
        if any(r.matcher is not None for r in reqs):
            self.grammars.apply_masks(logits, [r.matcher for r in reqs])
        result = self.sampler.sample(logits, reqs) if reqs else None
        t3 = time.perf_counter()
        st.sample_seconds += t3 - t2
        st.forward_seconds += t3 - t0
        self.stats.steps += 1
        self.stats.forward_tokens += sum(it.length for it in items)

        sampled_at = {id(it.req): j for j, it in enumerate(sampling)}
        for it in items:
            req = it.req
            if it.verify:
                r0 = verify_rows[id(req)]
                v = self.spec.verify(it, all_logits[r0 : r0 + it.length], self._mask_row, self._stop_reason)
                self.stats.generated_tokens += len(v.tokens)
                if v.reason is not None:
                    self.scheduler.finish(req, v.reason)
                    req.finish_time = time.monotonic()
                outs.append(StepOutput(req, v.tokens, v.logprobs, req.finished))
                continue
            req.computed += it.length
            j = sampled_at.get(id(req))
            if j is None:
                self.scheduler.cache_prefix(req)  # a prefill chunk: share it right away
                continue
            assert result is not None
            if req.first_token_time is None:  # (a continuation's prompt includes its resumed output)
                self.scheduler.cache_prefix(req)  # the whole prompt is computed: share it
                req.first_token_time = time.monotonic()
                self.stats.cached_prompt_tokens += req.cached_tokens
            tok = result.token_ids[j]
            lp = result.logprobs[j]
            if req.matcher is not None and not req.matcher.accept_token(tok):
                # NOTE: only possible when the grammar allowed no token at all (what it requires
                # next cannot be written with this vocabulary): the caller's constraint, a 400.
                assert not torch.isfinite(logits[j]).any(), f"{req.rid}: the grammar refused sampled token {tok}"
                req.error = unsatisfiable(req)
                self.scheduler.finish(req, FinishReason.REJECTED)
                req.finish_time = time.monotonic()
                outs.append(StepOutput(req, [], [], True))
                continue
            req.output_ids.append(tok)
            if lp is not None:
                req.output_logprobs.append(lp)
            self.stats.generated_tokens += 1
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                req.finish_time = time.monotonic()
            outs.append(StepOutput(req, [tok], [lp] if lp is not None else [], req.finished))
        for o in outs:
            if o.finished:
                self._reqs.pop(o.req.rid, None)
        st.bookkeeping_seconds += time.perf_counter() - t3
        return self._deliver(outs)

    # ------------------------------------------------------------------ prompt logprobs
    def _score_prompts(self) -> None:
        """Compute the prompt logprobs of the oldest waiting group (one per step, so a long
        prompt delays the running requests by one prefill at most), then queue it."""
        while self._scoring:
            live = [r for r in self._scoring[0] if not r.finished]
            if not live:  # aborted while waiting: step() reports it
                self._scoring.pop(0)
                continue
            if not score_prompt(live[0], self.runner, self.pool.allocator, self.cache, self.config.chunk_size):
                return  # no scratch KV yet: try again next step, keeping the order
            self._scoring.pop(0)
            for r in live[1:]:
                r.prompt_logprobs = live[0].prompt_logprobs
            self._enqueue(live)
            return

    # ------------------------------------------------------------------ speculation
    # Drafts (grammar-forced text, n-gram lookups, a draft model's guesses) are attached to
    # decode items by ``self.spec`` after scheduling and verified in the same forward pass; see
    # engine/speculative.
    def _mask_row(self, row: torch.Tensor, matcher: Any) -> None:
        self.grammars.apply_masks(row, [matcher])

    def _deliver(self, outs: list[StepOutput]) -> list[StepOutput]:
        """File each output in its stream's inbox (if one is listening); free idle memory."""
        for o in outs:
            r = o.req
            if r.prompt_logprobs is not None and not r.prompt_logprobs_reported:
                o.prompt_logprobs = r.prompt_logprobs
                r.prompt_logprobs_reported = True
            box = self._inboxes.get(o.req.rid)
            if box is not None:
                box.append(o)
        if not self.scheduler.running and self.runner.mirror is not None:
            self.runner.mirror.drop()  # idle: give the dense decode rows back
        return outs

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

    # ------------------------------------------------------------------ offline API
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched. One output per prompt (``n`` per prompt
        when ``n`` > 1, copies adjacent), in input order."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]  # type: ignore[list-item]  # one prompt (text or token ids)
        else:
            plist = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise ValueError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
        # Validate every prompt before queueing any: a bad one must not orphan the others.
        groups = [self._prepare(p, sp, None) for p, sp in zip(plist, params_list, strict=True)]
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
            self._enqueue(g)
        mine = {r.rid for g in groups for r in g}
        while any(not r.finished for g in groups for r in g):
            self.step()
        for rid in mine:
            self._reqs.pop(rid, None)
        return [self._output(r) for g in groups for r in g]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
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
            self._inboxes[rid] = inbox
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
                    r = o.req
                    if r.rid in done:
                        continue
                    text = detok[r.rid].push(o.new_token_ids)
                    if o.finished:
                        text += detok[r.rid].flush()
                        done.add(r.rid)
                    yield StreamDelta(
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
        finally:
            for rid, r in mine.items():
                self._inboxes.pop(rid, None)
                if not r.finished:
                    self.scheduler.abort(r)
                    self._reqs.pop(rid, None)

    def _output(self, r: Req) -> RequestOutput:
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
        )

    # ------------------------------------------------------------------ checks
    def assert_consistent(self) -> None:
        """KV ownership invariant (see ``Scheduler.assert_consistent``)."""
        self.scheduler.assert_consistent()

    def reset_prefix_cache(self) -> None:
        self.cache.reset()


def _advance(req: Req) -> str | None:
    """Feed a continued copy's resumed output to its fresh grammar matcher (the invariant: a
    matcher has accepted exactly ``output_ids``); why not, if the grammar refuses it."""
    for k, t in enumerate(req.output_ids):
        if not req.matcher.accept_token(t):
            return (f"the continuation's token {t} at output position {k} does not follow the request's "
                    "output constraint")
    if req.output_ids and req.matcher.is_terminated():
        return "the continuation's output already completes the request's output constraint: it had finished"
    return None


def unsatisfiable(req: Req) -> str:
    return (f"the output constraint allows no token at output position {len(req.output_ids)}: what it requires "
            "next cannot be written with this model's vocabulary; change the constraint")
