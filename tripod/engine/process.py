"""The engine process: one ``Engine`` driven in a loop, fed and drained over ZMQ.

It speaks token ids only. Between steps it drains every queued message (adds, aborts, stats
queries), runs one ``Engine.step()`` when there is work, sends that step's new tokens in one
``Outputs`` message, and sends a ``Heartbeat`` at least every ``heartbeat_interval`` seconds (busy
or idle) so the server can tell a live loop from a hung or dead one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from tripod.protocol import engine_ipc
from tripod.protocol.stats import (
    ComputeCard,
    DiskTierStats,
    EngineStats,
    SpecDecodeCounts,
    StepTimes,
)

if TYPE_CHECKING:
    from tripod.engine.request import TokenLogprob

log = logging.getLogger("tripod.engine.process")


def engine_main(launch: engine_ipc.EngineLaunch) -> None:
    """Entry point of the spawned engine process."""
    to_engine, from_engine, log_level = launch.to_engine, launch.from_engine, launch.log_level
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s", stream=sys.stderr
    )
    # NOTE: Ctrl-C reaches the whole process group; the server decides how to drain, then tells
    # us to stop. SIGTERM keeps its default (dies): a supervisor that kills us means it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
        from tripod.engine.engine import Engine

        engine = Engine(config=launch.engine_config)
        push.send(engine_ipc.encode(engine_ipc.Ready(
            pid=os.getpid(),
            model_name=engine.model_name,
            dtype=engine.dtype_name,
            quantization=engine.loaded.quantization,
            architecture=engine.model_config.architecture,
            context_len=engine.context_len,
            max_request_len=engine.max_request_len,
            vocab_size=engine.model_config.vocab_size,
            max_running=engine.config.max_running,
            kv_slots=engine.pool.allocator.num_slots,
            compute=ComputeCard(**engine.runner.card()),
            kv_tier=_tier_card(engine),
            loras=dict(engine.loras.paths) if engine.loras is not None else None,
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
        self, engine: Any, pull: zmq.Socket, push: zmq.Socket, heartbeat_interval: float, parent_pid: int,
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
        self._admitted: dict[Any, float] = {}
        self._reported: set[Any] = set()  # sequences whose first output carried their times

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while self.running:
            busy = self.engine.pending
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
            if self.engine.pending:
                step_start = time.monotonic() if self.timings else 0.0
                outs = self.engine.step()
                if self.timings:
                    self._note_admitted(step_start)
                t2 = time.perf_counter()
                self._send_outputs(outs, step_start)
                self.ipc_seconds += time.perf_counter() - t2
            now = time.monotonic()
            if now - self._last_heartbeat >= self.heartbeat_interval:
                self._last_heartbeat = now
                self.engine.check_workers()  # a lost tensor-parallel rank ends the engine, idle or not
                self.push.send(engine_ipc.encode(engine_ipc.Heartbeat(self.stats())))

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
            if isinstance(msg, engine_ipc.AddRequest):
                self._add(msg)
            elif isinstance(msg, engine_ipc.AbortRequest):
                self.engine.abort(msg.rid)
            elif isinstance(msg, engine_ipc.StatsRequest):
                self.push.send(engine_ipc.encode(engine_ipc.StatsReply(msg.token, self.stats(check=True))))
            elif isinstance(msg, engine_ipc.ExportKV):
                self._export(msg)
            elif isinstance(msg, engine_ipc.LoraRequest):
                self.push.send(engine_ipc.encode(self._lora(msg)))
            elif isinstance(msg, engine_ipc.Shutdown):
                self.running = False
            else:
                raise AssertionError(f"unexpected message {msg!r}")

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
                                   tenant=msg.tenant, weight=msg.weight)
        except ValueError as e:
            # The server validates first (with the same SamplingParams); this is the backstop so
            # a request is never lost.
            self._reject(msg.rid, msg.params.n, str(e))

    def _export(self, msg: engine_ipc.ExportKV) -> None:
        try:
            reply = engine_ipc.KVExport(msg.token, self.engine.export_kv(msg.prompt_ids))
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

    def _timing(self, o: Any, step_start: float) -> engine_ipc.SeqTiming | None:
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

    def _send_outputs(self, outs: list[Any], step_start: float = 0.0) -> None:
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
            ))
        if items:
            self.push.send(engine_ipc.encode(engine_ipc.Outputs(items)))

    def stats(self, check: bool = False) -> EngineStats:
        """The engine's counters as the protocol's snapshot (read here, not in the engine, so the
        engine keeps no knowledge of the wire)."""
        e = self.engine
        s = e.scheduler
        es = e.stats
        out = EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_slots=e.pool.allocator.num_slots,
            kv_free=e.pool.allocator.num_free,
            kv_cached=e.cache.total_size,
            kv_pinned=e.cache.protected_size,
            prefix_hit_tokens=e.cache.stats.hit_tokens,
            prefix_query_tokens=e.cache.stats.query_tokens,
            generated_tokens=es.generated_tokens,
            prompt_tokens=es.prompt_tokens,
            steps=es.steps,
            retractions=s.num_retractions,
            jump_forward_proposed=es.jump_forward_proposed,
            jump_forward_accepted=es.jump_forward_accepted,
            prefill_tokens=es.prefill_tokens,
            spec_decode={name: SpecDecodeCounts(c.drafts, c.draft_tokens, c.accepted_tokens)
                         for name, c in es.spec.items()},
            compute=e.runner.describe(),
            compute_card=ComputeCard(**e.runner.card()),
            time=StepTimes(
                schedule=es.schedule_seconds, prepare=es.prepare_seconds, decode_forward=es.decode_forward_seconds,
                prefill_forward=es.prefill_forward_seconds, sample=es.sample_seconds,
                bookkeeping=es.bookkeeping_seconds, ipc=self.ipc_seconds, idle=self.idle_seconds,
            ),
        )
        disk = e.cache.disk
        if disk is not None:
            t, c, d = disk.tier, disk.tier.counters, disk.stats
            out.kv_disk = DiskTierStats(
                dir=str(t.dir), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes, entries=t.entries,
                block_tokens=disk.block, hit_tokens=d.hit_tokens, loaded_tokens=d.loaded_tokens,
                saved_tokens=d.saved_tokens, written_blocks=c.written_blocks, written_bytes=c.written_bytes,
                dropped_blocks=c.dropped_blocks, read_blocks=c.read_blocks, prefetched_blocks=c.prefetched_blocks,
                corrupt_files=c.corrupt_files, evicted_files=c.evicted_files, load_seconds=d.load_seconds,
                save_seconds=d.save_seconds)
        if check:
            self._check(out)
        return out

    def _check(self, out: EngineStats) -> None:
        """The KV ownership invariant, provable only when no request holds memory (aborted
        requests not yet reported hold none: abort releases at once)."""
        out.consistent = None
        if not self.engine.has_work:
            try:
                self.engine.assert_consistent()
                out.consistent = True
            except AssertionError as err:
                out.consistent = False
                out.inconsistency = str(err)


def _tier_card(engine: Any) -> engine_ipc.KVTierCard | None:
    disk = engine.cache.disk
    if disk is None:
        return None
    lay = disk.tier.layout
    return engine_ipc.KVTierCard(dir=str(disk.tier.dir), identity=lay.identity.hex(), num_layers=lay.num_layers,
                                 row_shape=list(lay.row_shape), dtype=str(lay.dtype).removeprefix("torch."),
                                 block_tokens=lay.block_tokens)


def _logprob(lp: TokenLogprob) -> engine_ipc.Logprob:
    return engine_ipc.Logprob(lp.token_id, lp.logprob, lp.top)


if __name__ == "__main__":
    # Started by EngineClient as ``python -m tripod.engine.process '<EngineLaunch as JSON>'``.
    engine_main(engine_ipc.decode_launch(sys.argv[1]))
