"""Draft → critique → revise, with two models and JSON-schema outputs between the steps.

A writer model drafts (a ``Draft``: title and body, constrained to the schema), a judge model
critiques it (a ``Critique``: a score and one issue), the writer revises; the critic runs once per
round. Every step's output is a pydantic model the model is constrained to, validated again at
every chainlet boundary.

    tripod chains serve examples/chains/draft_critique_revise.py --port 8000
    curl -s localhost:8000/run -d '{"topic": "tides", "rounds": 1}'

    python examples/chains/draft_critique_revise.py "tides"      # run_local, starting the models here
"""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

from pydantic import BaseModel, Field

from tripod import chains

# The two models (by default both the embedded SmolLM2; `--model writer=PATH` serves another).
WRITER = chains.Model("writer")
JUDGE = chains.Model("judge")


class Draft(BaseModel):
    title: str = Field(max_length=48)
    body: str = Field(max_length=240)


class Critique(BaseModel):
    score: int = Field(ge=1, le=10)
    issue: str = Field(max_length=100)


class Essay(BaseModel):
    topic: str
    first_draft: Draft
    critiques: list[Critique]
    final: Draft


class Drafter(chains.Chainlet):
    llm = chains.llm(model=WRITER, temperature=0.0, max_tokens=96)

    async def run(self, topic: str) -> Draft:
        return await self.llm.chat(f"Write a title and a short paragraph about {topic}.", response_model=Draft)


class Critic(chains.Chainlet):
    llm = chains.llm(model=JUDGE, temperature=0.0, max_tokens=48)

    async def run(self, draft: Draft) -> Critique:
        return await self.llm.chat(
            f"Rate this paragraph from 1 to 10 and name its main weakness.\n\nTitle: {draft.title}\n{draft.body}",
            system="You are a strict editor.", response_model=Critique)


class Reviser(chains.Chainlet):
    llm = chains.llm(model=WRITER, temperature=0.0, max_tokens=96)

    async def run(self, draft: Draft, critique: Critique) -> Draft:
        return await self.llm.chat(
            f"Improve this paragraph. An editor said: {critique.issue}\n\nTitle: {draft.title}\n{draft.body}",
            response_model=Draft)


@chains.entrypoint
class Editor(chains.Chainlet):
    def __init__(self, drafter=chains.depends(Drafter, retries=2, timeout_s=120),
                 critic=chains.depends(Critic, retries=2, timeout_s=120),
                 reviser=chains.depends(Reviser, retries=2, timeout_s=120)):
        self.drafter, self.critic, self.reviser = drafter, critic, reviser

    async def run(self, topic: str, rounds: Annotated[int, Field(ge=0, le=3)] = 1) -> Essay:
        first = draft = await self.drafter.run(topic=topic)
        critiques = []
        for _ in range(rounds):
            critique = await self.critic.run(draft=draft)
            critiques.append(critique)
            draft = await self.reviser.run(draft=draft, critique=critique)
        return Essay(topic=topic, first_draft=first, critiques=critiques, final=draft)


async def main(topic: str) -> None:
    async with chains.run_local(launch_models=True):
        essay = await Editor().run(topic=topic)
        print(essay.model_dump_json(indent=2))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "tides"))
