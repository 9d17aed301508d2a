"""The engine process of an encoder model (``tripod serve --model all-minilm-l6-v2``): pooled
embeddings instead of generation, over the same pipe and messages as a decoder's engine.

``EncoderLoop`` owns the encoder (``tripod.models.bert``) and its queue: each turn it drains every
message that has come, runs all waiting ``EmbedRequest``s' inputs as one padded batch (the
encoder's attention is masked per row, so a text's embedding does not depend on what else is in
the batch) and answers each with ``Embeddings``. No KV is kept. A generation request
(``AddRequest``) is refused (``finish_reason: rejected``): an encoder does not generate.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import zmq

from tripod.models.bert import BertEncoder, load_encoder
from tripod.protocol import engine_ipc
from tripod.protocol.stats import ComputeCard, EngineStats

log = logging.getLogger("tripod.engine.encoder")

MAX_BATCH_INPUTS = 256  # inputs per forward (a bigger queue is run in several)


class EncoderLoop:
    """Messages → batched encoder forwards → ``Embeddings``; heartbeats as the decoder loop's."""

    def __init__(self, folder: Path, pull: zmq.Socket, push: zmq.Socket, launch: engine_ipc.EngineLaunch) -> None:
        self.pull, self.push = pull, push
        self.heartbeat_interval, self.parent_pid = launch.heartbeat_interval, launch.parent_pid
        t0 = time.monotonic()
        self.encoder: BertEncoder = load_encoder(folder)
        c = self.encoder.config
        log.info("tripod encoder: %s (%s, %d layers, hidden %d, pooling %s%s) float32, loaded in %.1fs",
                 folder.name, c.architecture, c.num_layers, c.hidden_size, c.pooling, " + normalize" if c.normalize else "",
                 time.monotonic() - t0)
        self.name = folder.name
        self.waiting: list[engine_ipc.EmbedRequest] = []
        self.prompt_tokens = 0
        self.steps = 0
        self.running = True

    def ready(self) -> engine_ipc.Ready:
        c = self.encoder.config
        return engine_ipc.Ready(
            pid=os.getpid(), model_name=self.name, dtype="float32", quantization="f32",
            architecture=c.architecture, context_len=c.max_positions, max_request_len=c.max_positions,
            vocab_size=c.vocab_size, max_running=MAX_BATCH_INPUTS, kv_slots=0, compute=self.card())

    @staticmethod
    def card() -> ComputeCard:
        return ComputeCard(backend="torch", reason="an encoder runs on torch (float32)")

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=len(self.waiting), kv_slots=0, kv_free=0, kv_cached=0, kv_pinned=0,
                           prompt_tokens=self.prompt_tokens, steps=self.steps, compute="encoder (torch float32)",
                           compute_card=self.card())

    def _send(self, msg: engine_ipc.Message) -> None:
        self.push.send(engine_ipc.encode(msg))

    def _drain(self) -> None:
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = engine_ipc.decode(raw)
            if isinstance(msg, engine_ipc.EmbedRequest):
                self.waiting.append(msg)
            elif isinstance(msg, engine_ipc.AddRequest):
                outs = [engine_ipc.SeqOutput(rid=msg.rid, index=i, token_ids=[], finish_reason="rejected",
                                             error="this server serves an encoder model (embeddings only); it "
                                             "does not generate: use /v1/embeddings")
                        for i in range(msg.params.n)]
                self._send(engine_ipc.Outputs(outs))
            elif isinstance(msg, engine_ipc.StatsRequest):
                self._send(engine_ipc.StatsReply(msg.token, self.stats()))
            elif isinstance(msg, engine_ipc.Shutdown):
                self.running = False

    def _step(self) -> None:
        """One batch of the waiting requests' inputs (whole requests, up to ``MAX_BATCH_INPUTS``)."""
        batch: list[engine_ipc.EmbedRequest] = []
        n = 0
        pairs = self.waiting[0].type_ids is not None  # NOTE: one kind per batch (pooled, or pairs scored)
        while (self.waiting and (self.waiting[0].type_ids is not None) == pairs
               and (not batch or n + len(self.waiting[0].inputs) <= MAX_BATCH_INPUTS)):
            req = self.waiting.pop(0)
            batch.append(req)
            n += len(req.inputs)
        ids = [x for r in batch for x in r.inputs]
        try:
            if pairs:
                scores = self.encoder.score(ids, [t for r in batch for t in r.type_ids or []])
                vectors = [[x] for x in scores]
            else:
                vectors = self.encoder.embed(ids)
        except (ValueError, KeyError) as e:  # (the server checks first; a bad batch still gets an answer)
            for r in batch:
                self._send(engine_ipc.Embeddings(r.rid, [], str(e)))
            return
        self.steps += 1
        at = 0
        for r in batch:
            self.prompt_tokens += sum(len(x) for x in r.inputs)
            self._send(engine_ipc.Embeddings(r.rid, vectors[at:at + len(r.inputs)]))
            at += len(r.inputs)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        last = 0.0
        while self.running:
            if poller.poll(0 if self.waiting else int(self.heartbeat_interval * 1000)):
                self._drain()
            if os.getppid() != self.parent_pid:
                log.warning("the server process is gone; stopping")
                return
            if self.waiting:
                self._step()
            now = time.monotonic()
            if now - last >= self.heartbeat_interval:
                self._send(engine_ipc.Heartbeat(self.stats()))
                last = now
