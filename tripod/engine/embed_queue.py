"""The ``EmbedRequest``s of an embedding engine (``--task embed``; the pooling itself is
``engine/pooling.py``): each input one engine request, run by the scheduler like any prefill; the
reply sent once all of a request's inputs are pooled. Used by the engine process's loop, and
offline (``EmbedQueue.embed``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tripod.engine.pooling import PoolState
from tripod.engine.request import FinishReason, Req, SamplingParams, StepOutput
from tripod.protocol import engine_ipc

if TYPE_CHECKING:
    from tripod.engine.engine import Engine


@dataclass(slots=True)
class _Pending:
    reqs: list[Req]
    error: str | None = None


@dataclass(slots=True)
class EmbedQueue:
    """The ``EmbedRequest``s an embedding engine is working on: each input one engine request,
    the reply sent when all of them are pooled. Also the offline ``embed``."""

    engine: Engine
    pending: dict[str, _Pending] = field(default_factory=dict)

    def add(self, msg: engine_ipc.EmbedRequest) -> list[engine_ipc.Embeddings]:
        """Queue every input of ``msg``; a refused one answers the whole request with its error now."""
        if msg.type_ids is not None:
            return [engine_ipc.Embeddings(msg.rid, [], "this server pools a decoder; pairs are scored by a "
                                          "cross-encoder (BertForSequenceClassification)")]
        reqs: list[Req] = []
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            for i, ids in enumerate(msg.inputs):
                (req,) = self.engine.add_request(ids, params, request_id=f"{msg.rid}#{i}")
                req.pooled = PoolState()
                reqs.append(req)
        except ValueError as e:
            for r in reqs:
                self.engine.abort(r.rid)
            return [engine_ipc.Embeddings(msg.rid, [], f"input[{len(reqs)}]: {e}")]
        self.pending[msg.rid] = _Pending(reqs)
        return []

    def collect(self, outs: list[StepOutput]) -> tuple[list[StepOutput], list[engine_ipc.Embeddings]]:
        """After a step: finish the requests whose prompt is pooled (their KV released now) and
        answer the ``EmbedRequest``s complete; returns the step's other outputs and the answers."""
        rest = [o for o in outs if o.req.pooled is None]
        for o in outs:  # (refused or failed before it ran: the request's error)
            if o.req.pooled is not None and o.finished and o.req.error is not None:
                p = self.pending.get(o.req.group.rpartition("#")[0])
                if p is not None and p.error is None:
                    p.error = o.req.error
        replies: list[engine_ipc.Embeddings] = []
        for rid, p in list(self.pending.items()):
            for r in p.reqs:
                if r.pooled.vector is not None and not r.finished:
                    self._finish(r)
            if p.error is not None or all(r.pooled.vector is not None for r in p.reqs):
                del self.pending[rid]
                for r in p.reqs:
                    if not r.finished:
                        self.engine.abort(r.rid)
                vectors = [] if p.error is not None else [r.pooled.vector for r in p.reqs]
                replies.append(engine_ipc.Embeddings(rid, vectors, p.error))
        return rest, replies

    def _finish(self, req: Req) -> None:
        # NOTE: the prompt is computed and nothing is sampled (ModelRunner leaves pooled rows out of
        # sampling), so the scheduler would never pick it again: finish it here, releasing its KV.
        eng = self.engine
        eng.scheduler.finish(req, FinishReason.STOP)
        req.finish_time = time.monotonic()
        eng.admission.reqs.pop(req.rid, None)

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """Offline: pool ``inputs`` through the engine's steps (batched like any prefill)."""
        rid = f"embed-{id(inputs)}"
        replies = self.add(engine_ipc.EmbedRequest(rid, inputs))
        while not replies:
            _, replies = self.collect(self.engine.step())
        (reply,) = replies
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply.vectors
