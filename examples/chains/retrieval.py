"""Retrieval-augmented answers over a small local document set: BM25 (``rank_bm25``, no network)
picks the passages, a writer model answers from them and names its sources.

    pip install -e ".[examples]"          # rank-bm25
    tripod chains serve examples/chains/retrieval.py --port 8000
    curl -s localhost:8000/run -d '{"question": "What causes spring tides?"}'

    python examples/chains/retrieval.py "What causes spring tides?"    # run_local, starting the model here
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from tripod import chains

WRITER = chains.Model("writer")
DOCS = Path(__file__).parent / "docs"
_STOP = frozenset("a an and are as at be by for from how in is it its of on or the to what when where which who "
                  "why with do does did".split())


def tokens(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOP]


class Passage(BaseModel):
    source: str
    text: str
    score: float


class Answer(BaseModel):
    question: str
    answer: str
    sources: list[str]


class Retriever(chains.Chainlet):
    """BM25 over every ``*.txt`` in ``docs/``, one passage per file, indexed once per replica."""

    def __init__(self) -> None:
        from rank_bm25 import BM25Okapi

        self.passages = [(p.stem, " ".join(p.read_text().split())) for p in sorted(DOCS.glob("*.txt"))]
        self.index = BM25Okapi([tokens(text) for _, text in self.passages])

    async def run(self, query: str, k: Annotated[int, Field(ge=1, le=10)] = 2) -> list[Passage]:
        scores = self.index.get_scores(tokens(query))
        best = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
        return [Passage(source=self.passages[i][0], text=self.passages[i][1], score=round(float(scores[i]), 4))
                for i in best if scores[i] > 0]


@chains.entrypoint
class Answerer(chains.Chainlet):
    llm = chains.llm(model=WRITER, temperature=0.0, max_tokens=64)

    def __init__(self, retriever=chains.depends(Retriever, retries=1, timeout_s=10)):
        self.retriever = retriever

    async def run(self, question: str, k: Annotated[int, Field(ge=1, le=10)] = 2,
                  max_tokens: Annotated[int, Field(ge=1, le=1024)] = 64) -> Answer:
        passages = await self.retriever.run(query=question, k=k)
        if not passages:
            return Answer(question=question, answer="None of the documents covers this.", sources=[])
        context = "\n\n".join(f"[{p.source}] {p.text}" for p in passages)
        text = await self.llm.chat(f"Answer from these documents only.\n\n{context}\n\nQuestion: {question}",
                                   system="Answer in one or two sentences.", max_tokens=max_tokens)
        return Answer(question=question, answer=text.strip(), sources=[p.source for p in passages])


async def main(question: str) -> None:
    async with chains.run_local(launch_models=True):
        print((await Answerer().run(question=question)).model_dump_json(indent=2))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "What causes spring tides?"))
