"""The server's side of the engine process: spawn it, feed it, route its outputs, watch it.

``EngineClient`` owns the engine process and both ZMQ pipes. Each HTTP request opens a
``RequestHandle`` (one or more engine requests sharing one queue); the receiver task files every
``SeqOutput`` in its handle's queue. The client also keeps the admission count (sequences the
engine holds) that backpressure is decided on, and notices a dead or hung engine at once: the
process's pidfd wakes the event loop the moment the process ends, and heartbeats older than
``heartbeat_timeout`` mean a hung loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from tripod import tracing
from tripod.config import EngineConfig, ServerConfig
from tripod.protocol import engine_ipc
from tripod.protocol.multimodal import ImageInput, ImageSpan
from tripod.protocol.sampling import Resume, SamplingParams
from tripod.protocol.stats import EngineStats

log = logging.getLogger("tripod.server")


class EngineDead(RuntimeError):
    """The engine process is gone (or hung); nothing more will be served."""


class Overloaded(RuntimeError):
    """The waiting queue is full."""


@dataclasses.dataclass(slots=True)
class EnginePart:
    """One engine request inside an HTTP request (a completions batch has several)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # built and validated once, here in the HTTP process
    # A continuation (the router's failover): only these copies run, each from the tokens it
    # had generated elsewhere. None: all ``params.n`` copies, from the start.
    resume: list[Resume] | None = None
    # Its images (vision-language models), in prompt order: each fills placeholder tokens of prompt_ids.
    images: list[ImageInput] = dataclasses.field(default_factory=list)

    @property
    def image_tokens(self) -> int:
        return sum(i.length for i in self.images)

    @property
    def copies(self) -> list[int]:
        """The copy indices this part runs."""
        return [r.index for r in self.resume] if self.resume is not None else list(range(self.params.n))


class RequestHandle:
    """The engine requests of one HTTP request and the queue their outputs arrive in.

    Owns the count of its unfinished sequences; ``close()`` aborts whatever is still running in
    the engine (a client that went away must not keep holding KV) and returns its admission.
    """

    def __init__(self, client: EngineClient, parts: list[EnginePart], n: int) -> None:
        self.client = client
        self.parts = parts
        self.n = n
        self.queue: asyncio.Queue[engine_ipc.SeqOutput | BaseException] = asyncio.Queue()
        self.open_seqs: set[tuple[str, int]] = {(p.rid, i) for p in parts for i in p.copies}
        self.closed = False

    def __aiter__(self) -> AsyncIterator[engine_ipc.SeqOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[engine_ipc.SeqOutput]:
        while self.open_seqs:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if (item.rid, item.index) not in self.open_seqs:
                continue  # a copy this request already ended (stop string): late tokens
            if item.finish_reason is not None:
                self._done(item.rid, item.index)
            yield item

    def stop_seq(self, rid: str, index: int) -> None:
        """End one sequence early (a stop string matched): abort it in the engine."""
        if (rid, index) in self.open_seqs:
            self._done(rid, index)
            self.client._send(engine_ipc.AbortRequest(rid if self.n == 1 else f"{rid}-{index}"))

    def _done(self, rid: str, index: int) -> None:
        self.open_seqs.discard((rid, index))
        self.client.inflight -= 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rid in {rid for rid, _ in self.open_seqs}:
            self.client._send(engine_ipc.AbortRequest(rid))
        self.client.inflight -= len(self.open_seqs)
        self.open_seqs.clear()
        for p in self.parts:
            self.client._handles.pop(p.rid, None)


class EngineProcess:
    """The engine's OS process: a plain child (``python -m tripod.engine.process``), so the
    server has exactly one child to supervise, and a pidfd that turns readable when it ends."""

    def __init__(self, args: list[str]) -> None:
        self.popen = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: the watchdog polls instead
            self._pidfd = None
        self._watching = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def watch(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        if self._pidfd is not None:
            loop.add_reader(self._pidfd, callback)
            self._watching = True

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._watching and self._pidfd is not None:
            loop.remove_reader(self._pidfd)
            self._watching = False

    def wait(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class EngineClient:
    """Owns the engine process, the ZMQ pipes to it and the routing of its outputs."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, log_level: int) -> None:
        self.engine_config = engine_config
        self.server_config = server_config
        self.log_level = log_level
        self.info: engine_ipc.Ready | None = None
        self.stats: EngineStats | None = None  # the latest heartbeat's
        self.last_heartbeat = 0.0
        self.dead_reason: str | None = None
        self.inflight = 0  # sequences the engine holds for us (admission control)
        self.on_death: Callable[[str], None] | None = None
        self.on_heartbeat: Callable[[EngineStats], None] | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._export_waiters: dict[int, asyncio.Future[engine_ipc.KVExport]] = {}
        self._lora_waiters: dict[int, asyncio.Future[engine_ipc.LoraReply]] = {}
        self._embed_waiters: dict[str, asyncio.Future[engine_ipc.Embeddings]] = {}
        self._control_waiters: dict[int, asyncio.Future[engine_ipc.ControlReply]] = {}
        # The engine's RL state (server/api/rl.py): weight version, pause mode, sleep level; from its replies.
        self.rl = engine_ipc.RLState(weight_version=0)
        self.loras: dict[str, str] | None = None  # LoRA adapters the engine serves (name -> path); None: none
        self._tokens = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._proc: EngineProcess | None = None
        self._tmpdir = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return self.info is not None and self.dead_reason is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def spawn(self) -> None:
        """Start the engine process now; ``start`` then connects and waits for it. Spawning early
        lets the engine load its model while this process loads the tokenizer and the app."""
        if self._proc is not None:
            return
        self._tmpdir = tempfile.mkdtemp(prefix="tripod-ipc-")
        self._proc = EngineProcess([
            sys.executable, "-m", "tripod.engine.process",
            engine_ipc.encode_launch(engine_ipc.EngineLaunch(
                engine_config=self.engine_config,
                to_engine=f"ipc://{self._tmpdir}/to-engine",
                from_engine=f"ipc://{self._tmpdir}/from-engine",
                heartbeat_interval=self.server_config.heartbeat_interval,
                log_level=self.log_level,
                parent_pid=os.getpid(),
                timings=tracing.ACTIVE,  # the engine's spans are made from them
            )),
        ])

    def abandon(self) -> None:
        """Kill a spawned engine that will never be started (start-up failed on our side)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            self._proc.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def start(self) -> engine_ipc.Ready:
        """Spawn the engine process (unless ``spawn`` did) and wait until its model is loaded."""
        self.spawn()
        assert self._proc is not None
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop or block a request under a burst
        # NOTE: the engine connects, we bind: it may have connected first (ZMQ queues and retries
        # the connection), so its Ready waits for us rather than getting lost.
        self._push.bind(f"ipc://{self._tmpdir}/to-engine")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(f"ipc://{self._tmpdir}/from-engine")
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[Any] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        self._proc.watch(loop, on_exit)
        recv: asyncio.Future[Any] = asyncio.ensure_future(self._pull.recv())
        done, _ = await asyncio.wait(
            {recv, exited}, timeout=self.server_config.engine_start_timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if recv not in done:
            recv.cancel()
            self._proc.kill()
            why = "exited" if exited in done else "did not start in time"
            raise EngineDead(f"the engine process {why} before it was ready (see the log above)")
        msg = engine_ipc.decode(recv.result())
        if isinstance(msg, engine_ipc.Fatal):
            raise EngineDead(f"the engine failed to start: {msg.message}")
        assert isinstance(msg, engine_ipc.Ready), msg
        self.info = msg
        self.loras = dict(msg.loras) if msg.loras is not None else None
        self.last_heartbeat = time.monotonic()
        # NOTE: the exit watch fires the moment the process ends, however it ends (crash,
        # kill -9, OOM): that is what makes /health turn at once.
        self._proc.unwatch(loop)
        self._proc.watch(loop, self._on_exit)
        self._tasks = [
            asyncio.create_task(self._receive(), name="engine-receive"),
            asyncio.create_task(self._watch(), name="engine-watchdog"),
        ]
        return msg

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, wait for it (kill it past ``timeout``), close the pipes."""
        self._stopping = True
        proc = self._proc
        if proc is not None:
            loop = asyncio.get_running_loop()
            proc.unwatch(loop)
            if proc.alive:
                self._send(engine_ipc.Shutdown())
                if not await loop.run_in_executor(None, proc.wait, timeout):
                    proc.kill()
                    proc.wait(5)
            proc.close()
        for t in self._tasks:
            t.cancel()
        for s in (self._push, self._pull):
            if s is not None:
                s.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _on_exit(self) -> None:
        assert self._proc is not None
        self._proc.unwatch(asyncio.get_running_loop())
        self._proc.wait(5)
        if not self._stopping:
            self._die(f"the engine process exited (code {self._proc.returncode})")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error("%s; failing %d open requests", reason, len(self._handles))
        err = EngineDead(reason)
        for h in list(self._handles.values()):
            h.queue.put_nowait(err)
        for fut in [*self._stats_waiters.values(), *self._export_waiters.values(), *self._embed_waiters.values(),
                    *self._control_waiters.values()]:
            if not fut.done():
                fut.set_exception(err)
        if self._proc is not None and self._proc.alive:
            self._proc.kill()
        if self.on_death is not None:
            self.on_death(reason)

    async def _watch(self) -> None:
        interval = self.server_config.heartbeat_interval
        while self.dead_reason is None:
            await asyncio.sleep(interval)
            if self._proc is not None and not self._proc.alive and not self._stopping:  # where no pidfd could watch it
                self._on_exit()
                return
            silent = time.monotonic() - self.last_heartbeat
            if silent > self.server_config.heartbeat_timeout:
                self._die(f"the engine loop sent no heartbeat for {silent:.0f} s (hung)")

    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            try:
                msg = engine_ipc.decode(await self._pull.recv())
            except engine_ipc.ProtocolError as e:  # nothing it sends can be trusted any more
                self._die(f"the engine sent an invalid message: {e}")
                return
            self.last_heartbeat = time.monotonic()  # any message proves the loop is alive
            if isinstance(msg, engine_ipc.Outputs):
                for item in msg.items:
                    h = self._handles.get(item.rid)
                    if h is not None:
                        h.queue.put_nowait(item)
            elif isinstance(msg, engine_ipc.Heartbeat):
                self.stats = msg.stats
                if self.on_heartbeat is not None:
                    self.on_heartbeat(msg.stats)
            elif isinstance(msg, engine_ipc.StatsReply):
                fut = self._stats_waiters.pop(msg.token, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)
            elif isinstance(msg, engine_ipc.KVExport):
                kfut = self._export_waiters.pop(msg.token, None)
                if kfut is not None and not kfut.done():
                    kfut.set_result(msg)
            elif isinstance(msg, engine_ipc.LoraReply):
                if self.loras is not None:
                    self.loras = dict(msg.loras)
                waiter = self._lora_waiters.pop(msg.token, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            elif isinstance(msg, engine_ipc.ControlReply):
                self.rl = msg.state
                cfut = self._control_waiters.pop(msg.token, None)
                if cfut is not None and not cfut.done():
                    cfut.set_result(msg)
            elif isinstance(msg, engine_ipc.Embeddings):
                efut = self._embed_waiters.pop(msg.rid, None)
                if efut is not None and not efut.done():
                    efut.set_result(msg)
            elif isinstance(msg, engine_ipc.Fatal):
                self._die(f"the engine loop failed: {msg.message}")
                return

    # ------------------------------------------------------------------ requests
    def capacity(self) -> int:
        assert self.info is not None
        return self.info.max_running + self.server_config.max_waiting

    def open(self, parts: list[EnginePart], n: int, *, tenant: str = "", weight: float = 1.0) -> RequestHandle:
        """Send ``parts`` to the engine; raises ``EngineDead`` or ``Overloaded`` instead.

        ``tenant``/``weight``: whose request this is and that tenant's share of the engine under
        contention (the scheduler's fair share); "" schedules as a request without tenants."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        seqs = sum(len(p.copies) for p in parts)
        if self.inflight > 0 and self.inflight + seqs > self.capacity():
            raise Overloaded(f"{self.inflight} sequences in flight; the queue holds {self.capacity()}")
        h = RequestHandle(self, parts, n)
        for p in parts:
            assert p.rid not in self._handles, p.rid
            self._handles[p.rid] = h
        self.inflight += seqs
        for p in parts:
            if p.copies:  # (a continuation's part whose every choice had finished runs nothing)
                self._send(engine_ipc.AddRequest(p.rid, p.prompt_ids, p.params, list(p.resume or []),
                                                  tenant=tenant, weight=weight, images=p.images))
        return h

    async def engine_stats(self, timeout: float = 10.0) -> EngineStats:
        """Ask the engine loop for its accounting now (includes the KV invariant when idle)."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        token = next(self._tokens)
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats_waiters[token] = fut
        self._send(engine_ipc.StatsRequest(token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(token, None)

    async def export_kv(self, prompt_ids: list[int], images: list[ImageInput] | None = None,
                        timeout: float = 60.0) -> engine_ipc.KVExport:
        """The whole blocks of ``prompt_ids`` the engine's prefix cache holds (``ExportKV``; its
        ``images``' tokens are keyed by their content, as the cache keys them)."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        token = next(self._tokens)
        fut: asyncio.Future[engine_ipc.KVExport] = asyncio.get_running_loop().create_future()
        self._export_waiters[token] = fut
        spans = [ImageSpan(i.hash, i.offset, i.length) for i in images or ()]
        self._send(engine_ipc.ExportKV(token, prompt_ids, spans))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._export_waiters.pop(token, None)

    async def lora(self, action: str, name: str = "", path: str = "", timeout: float = 60.0) -> engine_ipc.LoraReply:
        """Load / unload / ask about a LoRA adapter in the engine (``LoraRequest``)."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        token = next(self._tokens)
        fut: asyncio.Future[engine_ipc.LoraReply] = asyncio.get_running_loop().create_future()
        self._lora_waiters[token] = fut
        self._send(engine_ipc.LoraRequest(token, action, name, path))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._lora_waiters.pop(token, None)

    def open_rids(self) -> list[str]:
        """The engine request ids of the HTTP requests open now."""
        return list(self._handles)

    async def control(self, make: Callable[[int], engine_ipc.Control], timeout: float) -> engine_ipc.ControlReply:
        """Send an RL control message (``make(token)``) and wait for its ``ControlReply``; raises
        ``EngineDead``, or ``TimeoutError`` past ``timeout`` (the engine still carries it out)."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        token = next(self._tokens)
        fut: asyncio.Future[engine_ipc.ControlReply] = asyncio.get_running_loop().create_future()
        self._control_waiters[token] = fut
        self._send(make(token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._control_waiters.pop(token, None)

    async def embed(self, rid: str, inputs: list[list[int]], type_ids: list[list[int]] | None = None,
                    ) -> engine_ipc.Embeddings:
        """Pool ``inputs`` (``type_ids``: score them as pairs) in an encoder engine; raises ``EngineDead``."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not running")
        fut: asyncio.Future[engine_ipc.Embeddings] = asyncio.get_running_loop().create_future()
        self._embed_waiters[rid] = fut
        self._send(engine_ipc.EmbedRequest(rid, inputs, type_ids))
        try:
            return await fut
        finally:
            self._embed_waiters.pop(rid, None)

    def _send(self, msg: engine_ipc.Message) -> None:
        if self._push is None or self.dead_reason is not None:
            return
        # NOTE: a PUSH socket with a connected peer queues without blocking (high-water mark
        # 1000 messages); the engine drains everything between steps.
        self._push.send(engine_ipc.encode(msg), copy=False)
