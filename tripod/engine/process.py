"""The engine process: one ``Engine`` driven in a loop, fed and drained over ZMQ.

Spawned by the server (``server/engine_client.py``) as ``python -m tripod.engine.process '<EngineLaunch
as JSON>'``: the process boundary is this package's boundary (the server imports nothing of
``tripod.engine``; the two speak ``tripod.protocol.engine_ipc``).

It speaks token ids only. Between steps it drains every queued message (adds, aborts, stats
queries), runs one ``Engine.step()`` when there is work, sends that step's new tokens in one
``Outputs`` message, and sends a ``Heartbeat`` (``Engine.snapshot()``) at least every
``heartbeat_interval`` seconds (busy or idle) so the server can tell a live loop from a hung or
dead one, and right after the step that leaves it idle (so the load it reports drops to zero with
the last answer, not an interval later).

Shutdown belongs to the server. SIGINT and SIGTERM are ignored here: delivered to the whole
process group (Ctrl-C in a terminal, systemd's default ``KillMode=control-group``) they are meant
for the server, which drains its answers and then sends ``Shutdown``; the engine then closes
(``Engine.close``: the prefix cache saved to the disk tier) and exits 0. It also stops by itself
when the server is gone (its parent pid changes).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

import zmq

from tripod.engine.embed_queue import EmbedQueue
from tripod.engine.encoder_loop import EncoderLoop
from tripod.engine.request import Req, StepOutput, TokenLogprob
from tripod.engine.rl_control import RLControl
from tripod.engine.routed_experts import finished_routing
from tripod.loader import encoder_folder
from tripod.memory.tiered_cache import TieredCache
from tripod.protocol import engine_ipc
from tripod.protocol.stats import ComputeCard, EngineStats

if TYPE_CHECKING:
    from tripod.engine.engine import Engine

log = logging.getLogger("tripod.engine.process")


def engine_main(launch: engine_ipc.EngineLaunch) -> None:
    """Entry point of the spawned engine process."""
    to_engine, from_engine, log_level = launch.to_engine, launch.from_engine, launch.log_level
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s", stream=sys.stderr
    )
    # NOTE: a group-wide SIGINT/SIGTERM (Ctrl-C, a service manager's stop) is for the server: it
    # drains, then tells us to stop, and we save the pool to the disk tier on the way out. Dying
    # here at once would lose both (the server only sees its engine exit with -15).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(to_engine)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(from_engine)
    code = 0
    engine = None
    try:
        folder = encoder_folder(launch.engine_config.model)
        if folder is not None:  # an encoder: pooled embeddings, no generation, no KV (engine/encoder_loop.py)
            loop = EncoderLoop(folder, pull, push, launch)
            push.send(engine_ipc.encode(loop.ready()))
            loop.run()
            return
        from tripod.engine.engine import Engine

        engine = Engine(config=launch.engine_config)
        push.send(engine_ipc.encode(engine_ipc.Ready(
            pid=os.getpid(),
            model_name=engine.model_name,
            dtype=engine.dtype_name,
            quantization=engine.loaded.quantization,
            quantization_detail=engine.loaded.quantization_detail,
            architecture=engine.model_config.architecture,
            context_len=engine.context_len,
            max_request_len=engine.max_request_len,
            vocab_size=engine.model_config.vocab_size,
            max_running=engine.config.max_running,
            kv_slots=engine.pool.allocator.num_slots,
            compute=ComputeCard(**engine.runner.card()),
            kv_tier=engine.cache.card() if isinstance(engine.cache, TieredCache) else None,
            loras=dict(engine.loras.paths) if engine.loras is not None else None,
            modalities=["text", "image"] if engine.vision.enabled else ["text"],
            state_bytes=engine.states.bytes_per_slot if engine.states is not None else 0,
        )))
        EngineLoop(engine, pull, push, launch.heartbeat_interval, launch.parent_pid, timings=launch.timings).run()
    except Exception as e:  # a crash must reach the server as a message, not only a dead pid
        log.error("engine process failed:\n%s", traceback.format_exc())
        push.send(engine_ipc.encode(engine_ipc.Fatal(f"{type(e).__name__}: {e}")))
        code = 1
    finally:
        if engine is not None:
            engine.close()  # tensor parallel: the workers go with the engine
        pull.close(0)
        push.close()
        ctx.term()
    sys.exit(code)


class EngineLoop:
    """Owns the step loop of one engine process and the mapping from ZMQ messages to it."""

    def __init__(
        self, engine: Engine, pull: zmq.Socket, push: zmq.Socket, heartbeat_interval: float, parent_pid: int,
        timings: bool = False,
    ) -> None:
        self.engine = engine
        self.pull = pull
        self.push = push
        self.heartbeat_interval = heartbeat_interval
        self.parent_pid = parent_pid
        self.running = True
        self._last_heartbeat = 0.0
        # Where the loop's time goes besides Engine.step (see benchmarks/serve_profile.py).
        self.idle_seconds = 0.0  # waiting for messages with nothing to run
        self.ipc_seconds = 0.0  # decoding incoming messages, encoding and sending outputs
        # Tracing (EngineLaunch.timings): when each sequence was first admitted (the start of the
        # step that admitted it), until its last output has reported it.
        self.timings = timings
        self._admitted: dict[Req, float] = {}
        self._reported: set[Req] = set()  # sequences whose first output carried their times
        # --task embed: the embedding requests being pooled (engine/pooling.py); None: a generative engine.
        self.embeds = EmbedQueue(engine) if engine.config.task == "embed" else None
        # Pause/continue, weight updates, sleep (engine/rl_control.py): what may step and be admitted.
        self.rl = RLControl(engine, lambda msg: self.push.send(engine_ipc.encode(msg)), self._beat)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while self.running:
            busy = self.engine.pending and not self.rl.frozen
            t0 = time.perf_counter()
            ready = poller.poll(0 if busy else int(self.heartbeat_interval * 1000))
            t1 = time.perf_counter()
            if not busy:
                self.idle_seconds += t1 - t0
            if ready:
                self._drain()
                self.ipc_seconds += time.perf_counter() - t1
            if os.getppid() != self.parent_pid:
                log.warning("the server process is gone; stopping")
                return
            stepped = self.engine.pending and not self.rl.frozen
            if stepped:
                step_start = time.monotonic() if self.timings else 0.0
                outs = self.engine.step()
                if self.embeds is not None:
                    outs, replies = self.embeds.collect(outs)
                    for reply in replies:
                        self.push.send(engine_ipc.encode(reply))
                if self.timings:
                    self._note_admitted(step_start)
                t2 = time.perf_counter()
                self._send_outputs(outs, step_start)
                self.ipc_seconds += time.perf_counter() - t2
            for held in self.rl.tick():  # (a waiting update applied once nothing is in flight)
                self._add(held)
            # NOTE: also at once when the loop has just gone idle: the server's /metrics (what routers
            # place requests by) would otherwise report the last finished request as running for up
            # to an interval after its answer was sent.
            self._beat(now=stepped and not self.engine.pending)

    def _drain(self) -> None:
        while self.running:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = engine_ipc.decode(raw)
            except engine_ipc.InvalidAddRequest as e:
                self._reject(e.rid, e.n, str(e))
                continue
            if isinstance(msg, engine_ipc.AddRequest) and self.embeds is not None:
                self._reject(msg.rid, msg.params.n, "this server pools its model into embeddings (--task embed); it "
                             "does not generate: use /v1/embeddings, or serve it without --task embed")
            elif isinstance(msg, engine_ipc.AddRequest):
                if not self.rl.hold(msg):
                    self._add(msg)
            elif isinstance(msg, engine_ipc.EmbedRequest):
                for reply in self.embeds.add(msg) if self.embeds is not None else [
                        engine_ipc.Embeddings(msg.rid, [], "this server does not pool: serve it with --task embed")]:
                    self.push.send(engine_ipc.encode(reply))
            elif isinstance(msg, engine_ipc.AbortRequest):
                self.engine.abort(msg.rid)
            elif isinstance(msg, engine_ipc.StatsRequest):
                self.push.send(engine_ipc.encode(engine_ipc.StatsReply(msg.token, self.stats(check=True))))
            elif isinstance(msg, engine_ipc.ExportKV):
                self._export(msg)
            elif isinstance(msg, engine_ipc.LoraRequest):
                self.push.send(engine_ipc.encode(self._lora(msg)))
            elif isinstance(msg, engine_ipc.Control):
                self.rl.handle(msg)
            elif isinstance(msg, engine_ipc.Shutdown):
                self.running = False
            else:
                raise AssertionError(f"unexpected message {msg!r}")

    def _beat(self, now: bool = False) -> None:
        """A heartbeat if one is due (or ``now``): each turn of the loop, and between the phases of a
        long control (a weight update), so the server does not take a loop busy with it for a hung one."""
        t = time.monotonic()
        if now or t - self._last_heartbeat >= self.heartbeat_interval:
            self._last_heartbeat = t
            self.engine.check_workers()  # a lost tensor-parallel rank ends the engine, idle or not
            self.push.send(engine_ipc.encode(engine_ipc.Heartbeat(self.stats())))

    def _lora(self, msg: engine_ipc.LoraRequest) -> engine_ipc.LoraReply:
        loras = self.engine.loras
        error, running = None, 0
        try:
            if msg.action == "load":
                self.engine.load_lora(msg.name, msg.path)
            elif msg.action == "unload":
                running = self.engine.unload_lora(msg.name)
            elif msg.action == "list" and loras is not None and msg.name:
                running = loras.in_use(msg.name)
        except ValueError as e:
            error = str(e)
        return engine_ipc.LoraReply(msg.token, error, dict(loras.paths) if loras is not None else {}, running)

    def _add(self, msg: engine_ipc.AddRequest) -> None:
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, request_id=msg.rid, resume=msg.resume or None,
                                   tenant=msg.tenant, weight=msg.weight, images=msg.images)
        except ValueError as e:
            # The server validates first (with the same SamplingParams); this is the backstop so
            # a request is never lost.
            self._reject(msg.rid, msg.params.n, str(e))

    def _export(self, msg: engine_ipc.ExportKV) -> None:
        try:
            reply = engine_ipc.KVExport(msg.token, self.engine.export_kv(msg.prompt_ids, msg.images))
        except ValueError as e:
            reply = engine_ipc.KVExport(msg.token, [], str(e))
        self.push.send(engine_ipc.encode(reply), copy=False)

    def _reject(self, rid: str, n: int, why: str) -> None:
        self.push.send(engine_ipc.encode(engine_ipc.Outputs([
            engine_ipc.SeqOutput(rid=rid, index=i, token_ids=[], finish_reason="rejected", error=why)
            for i in range(n)
        ])))

    def _note_admitted(self, step_start: float) -> None:
        """Sequences running now that were not before this step began their prefill in it."""
        s = self.engine.scheduler
        for r in s.running:
            if r not in self._admitted:
                self._admitted[r] = step_start
        if len(self._admitted) > 4 * (len(s.running) + len(s.waiting)) + 64:
            # Aborted sequences never report their last output: forget those the scheduler no longer holds.
            held = set(s.running) | set(s.waiting)
            self._admitted = {r: t for r, t in self._admitted.items() if r in held}
            self._reported &= held

    def _timing(self, o: StepOutput, step_start: float) -> engine_ipc.SeqTiming | None:
        """A sequence's times, on its first output and on its last (None on the others)."""
        r = o.req
        first = r not in self._reported
        if not (first or o.finished):
            return None
        # NOTE: a sequence admitted and finished within one step was never seen running: this step.
        scheduled = self._admitted.get(r, step_start)
        if o.finished:
            self._admitted.pop(r, None)
            self._reported.discard(r)
        else:
            self._reported.add(r)
        finished = (r.finish_time or time.monotonic()) if o.finished else None
        return engine_ipc.SeqTiming(r.arrival, scheduled, r.first_token_time, finished)

    def _send_outputs(self, outs: list[StepOutput], step_start: float = 0.0) -> None:
        items = []
        for o in outs:
            r = o.req
            items.append(engine_ipc.SeqOutput(
                rid=r.group,
                index=r.index,
                token_ids=o.new_token_ids,
                logprobs=[_logprob(lp) for lp in o.new_logprobs],
                finish_reason=r.finish_reason.value if o.finished and r.finish_reason else None,  # "rejected": 400
                cached_tokens=r.cached_tokens,
                error=r.error,
                prompt_logprobs=None if o.prompt_logprobs is None else [
                    _logprob(lp) if lp is not None else engine_ipc.Logprob(r.prompt_ids[0], None, [])
                    for lp in o.prompt_logprobs
                ],
                timing=self._timing(o, step_start) if self.timings else None,
                weight_version=self.rl.weights.version,
                routed_experts=finished_routing(r) if o.finished else None,
            ))
        if items:
            self.push.send(engine_ipc.encode(engine_ipc.Outputs(items)))

    def stats(self, check: bool = False) -> EngineStats:
        """The engine's snapshot, with the loop's own time (idle, IPC) in it."""
        out = self.engine.snapshot(check=check)
        out.time.ipc, out.time.idle = self.ipc_seconds, self.idle_seconds
        return out


def _logprob(lp: TokenLogprob) -> engine_ipc.Logprob:
    return engine_ipc.Logprob(lp.token_id, lp.logprob, lp.top)


if __name__ == "__main__":
    # Started by EngineClient as ``python -m tripod.engine.process '<EngineLaunch as JSON>'``.
    engine_main(engine_ipc.decode_launch(sys.argv[1]))
