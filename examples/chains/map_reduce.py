"""Map-reduce summarization: split a text into chunks, summarize them in parallel (fan-out over the
mapper's replicas), then reduce the partial summaries into one answer streamed as it is generated.

    tripod chains serve examples/chains/map_reduce.py --port 8000
    curl -sN localhost:8000/run -d '{"text": "...a long text..."}'     # SSE: one data: line per piece

    python examples/chains/map_reduce.py < some.txt       # run_local, starting the model here
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Annotated

from pydantic import Field

from tripod import chains

WRITER = chains.Model("writer")


def chunks(text: str, words: int) -> list[str]:
    w = text.split()
    return [" ".join(w[i: i + words]) for i in range(0, len(w), words)] or [""]


class Mapper(chains.Chainlet):
    llm = chains.llm(model=WRITER, temperature=0.0, max_tokens=32)

    async def run(self, chunk: str) -> str:
        text = await self.llm.chat(f"Summarize in one sentence:\n\n{chunk}")
        return text.strip()


@chains.entrypoint
class Summarizer(chains.Chainlet):
    llm = chains.llm(model=WRITER, temperature=0.0)

    def __init__(self, mapper=chains.depends(Mapper, retries=2, timeout_s=120, replicas=2)):
        self.mapper = mapper

    async def run(self, text: str, chunk_words: Annotated[int, Field(ge=8)] = 80,
                  max_tokens: Annotated[int, Field(ge=1, le=4096)] = 64, ignore_eos: bool = False) -> AsyncIterator[str]:
        parts = await asyncio.gather(*(self.mapper.run(chunk=c) for c in chunks(text, chunk_words)))
        notes = "\n".join(f"- {p}" for p in parts)
        async for piece in self.llm.stream(f"Combine these notes into one short summary:\n{notes}",
                                           max_tokens=max_tokens, ignore_eos=ignore_eos):
            yield piece


async def main(text: str) -> None:
    async with chains.run_local(launch_models=True):
        async for piece in Summarizer().run(text=text):
            print(piece, end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main(sys.stdin.read()))
