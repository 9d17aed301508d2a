"""A TCP proxy on loopback that delays every byte by a fixed time each way: a replica "in another
region" as a router sees it. Order and throughput are kept (each direction is a queue of chunks,
each forwarded ``delay`` seconds after it arrived), so streams and keep-alive work as over a long
link. ``cut()`` drops every connection and refuses new ones, as a region that died would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class LatencyProxy:
    def __init__(self, upstream: str, delay: float) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.delay = delay
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                await asyncio.sleep(max(0.0, at + self.delay - time.monotonic()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(forward())
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((time.monotonic(), data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()

    def cut(self) -> None:
        """Drop every connection and refuse new ones (the far region is gone)."""

        def drop() -> None:
            self._cut = True
            for w in list(self._writers):
                w.transport.abort()

        self._loop.call_soon_threadsafe(drop)

    def close(self) -> None:
        def stop() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)
