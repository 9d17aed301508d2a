"""tripod.chains: multi-step, multi-model workflows as typed Python, run locally or served.

    from tripod import chains

    class Critic(chains.Chainlet):
        llm = chains.llm(model="judge", temperature=0)
        async def run(self, draft: str) -> Verdict: ...

    @chains.entrypoint
    class Writer(chains.Chainlet):
        def __init__(self, critic=chains.depends(Critic, retries=2, timeout_s=30)):
            self.critic = critic
        async def run(self, topic: str) -> Essay: ...

    with chains.run_local(models={"judge": "http://127.0.0.1:8000"}):
        essay = await Writer().run(topic="tides")

Deployed: ``tripod chains serve FILE.py`` (see ``tripod.chains.chain_server`` and docs/chains.md).
"""

from __future__ import annotations

from tripod.chains.core import (
    Chainlet,
    Dependency,
    Graph,
    LLMSpec,
    Model,
    Signature,
    current,
    depends,
    entrypoint,
    llm,
    signature,
)
from tripod.chains.errors import ChainError, ChainletError, LLMError
from tripod.chains.llm_client import Endpoint, LLMClient
from tripod.chains.local import LocalRuntime, run_local
from tripod.chains.metrics import ChainMetrics
from tripod.chains.runtime import Handle

__all__ = [
    "ChainError",
    "ChainMetrics",
    "Chainlet",
    "ChainletError",
    "Dependency",
    "Endpoint",
    "Graph",
    "Handle",
    "LLMClient",
    "LLMError",
    "LLMSpec",
    "LocalRuntime",
    "Model",
    "Signature",
    "current",
    "depends",
    "entrypoint",
    "llm",
    "run_local",
    "signature",
]
