"""A chain without models, for the served-chain tests: every behaviour of calls between chainlets
(validation, retries, timeouts, streaming, cancellation) without an LLM's start-up cost.

Tests steer the chainlets through their arguments and observe them through files in ``scratch``
(a folder the test gives): a chainlet writes ``<name>.pid`` when a call reaches it, and
``<name>.cancelled`` when its work is cancelled.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from pydantic import BaseModel, Field

from tripod import chains


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0)
    note: str


def _mark(scratch: str | None, name: str) -> None:
    if scratch:
        Path(scratch, name).write_text(str(os.getpid()))


class Critic(chains.Chainlet):
    """Scores a draft; ``hold_s`` keeps the call open (so a test can kill this process mid-call)."""

    async def run(self, draft: str, hold_s: float = 0.0, scratch: str | None = None) -> Verdict:
        _mark(scratch, "Critic.pid")
        try:
            await asyncio.sleep(hold_s)
        except asyncio.CancelledError:
            _mark(scratch, "Critic.cancelled")
            raise
        return Verdict(ok=len(draft) >= 10, score=len(draft), note=f"{len(draft.split())} words")


class Ticker(chains.Chainlet):
    """Streams ``n`` ticks; after the first it waits for ``scratch/go`` before going on."""

    async def run(self, n: int, scratch: str | None = None, gate: bool = False) -> AsyncIterator[int]:
        for i in range(n):
            if gate and i == 1 and scratch:
                _mark(scratch, "Ticker.first-sent")
                while not Path(scratch, "go").exists():
                    try:
                        await asyncio.sleep(0.02)  # NOTE: polls a file the test writes (another process)
                    except asyncio.CancelledError:
                        _mark(scratch, "Ticker.cancelled")
                        raise
            yield i


@chains.entrypoint
class Writer(chains.Chainlet):
    def __init__(self, critic=chains.depends(Critic, retries=2, timeout_s=20, replicas=2, backoff_s=0.05),
                 slow_critic=chains.depends(Critic, timeout_s=0.5)):
        self.critic = critic
        self.slow_critic = slow_critic

    async def run(self, topic: str, n: int = 2, hold_s: float = 0.0, scratch: str | None = None,
                  mode: str = "normal") -> list[Verdict]:
        drafts = [f"{topic} " * (i + 1) for i in range(n)]
        if mode == "timeout":
            return [await self.slow_critic.run(draft=drafts[0], hold_s=hold_s, scratch=scratch)]
        if mode == "bad_call":
            return [await self.critic.run(draft=drafts[0], hold_s="soon")]
        return list(await asyncio.gather(*(self.critic.run(draft=d, hold_s=hold_s, scratch=scratch)
                                           for d in drafts)))


class Relay(chains.Chainlet):
    """A streaming entrypoint (serve with --entrypoint Relay): relays Ticker's ticks as they come."""

    def __init__(self, ticker=chains.depends(Ticker, retries=1)):
        self.ticker = ticker

    async def run(self, n: int = 3, scratch: str | None = None, gate: bool = False) -> AsyncIterator[str]:
        async for i in self.ticker.run(n=n, scratch=scratch, gate=gate):
            yield f"tick {i}"
