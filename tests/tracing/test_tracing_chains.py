"""Tracing across a chain's hops (``tripod.chains`` with ``tripod.tracing`` on): two chainlet
workers, each a real worker app over HTTP in this process, the outer one calling the inner one
through a ``RemoteHandle`` and an LLM (a stub replica) through its ``LLMClient``. One trace: the
caller's span → ``chains.call`` → the outer worker's ``chains.request`` → ``chains.call`` → the
inner worker's ``chains.request``; the LLM call carries the outer worker's ``traceparent``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.router.stubs import ServerThread, Stub
from tripod import chains, tracing
from tripod.chains.core import Dependency
from tripod.chains.llm_client import ClientPool
from tripod.chains.metrics import ChainMetrics
from tripod.chains.remote import RemoteHandle, StaticSource
from tripod.chains.worker import ServedRuntime, build_worker_app


class Inner(chains.Chainlet):
    async def run(self, text: str) -> str:
        return text.upper()


class Outer(chains.Chainlet):
    llm = chains.llm("stub-model")

    def __init__(self, inner: Any = chains.depends(Inner)) -> None:
        self.inner = inner

    async def run(self, text: str) -> str:
        said = await self.llm.chat(text)
        return await self.inner.run(text=text) + " / " + said


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use(provider)
    try:
        yield exp
    finally:
        tracing.use(None)


def worker(cls: type[chains.Chainlet], runtime: ServedRuntime) -> ServerThread:
    token = runtime.activate()
    try:
        instance = cls()
    finally:
        runtime.deactivate(token)
    return ServerThread(build_worker_app(instance, cls.__tripod_signature__, ChainMetrics()), lifespan="off")


def test_one_trace_across_chain_hops_and_the_llm_call(exporter: InMemorySpanExporter) -> None:
    llm = Stub("llm")
    made: list[Any] = [llm]
    try:
        clients = ClientPool(None)
        inner = worker(Inner, ServedRuntime(llm.url, ChainMetrics(), StaticSource({}), clients))
        made.append(inner)
        runtime = ServedRuntime(llm.url, ChainMetrics(), StaticSource({"Inner": [inner.url]}), ClientPool(None))
        outer = worker(Outer, runtime)
        made.append(outer)

        async def call() -> Any:
            handle = RemoteHandle(Dependency(Outer), "client", ChainMetrics(), StaticSource({"Outer": [outer.url]}),
                                  ClientPool(None))
            root = tracing.start_span("test.root")
            try:
                with tracing.current(root):
                    return await handle.run(text="hi"), root
            finally:
                tracing.end(root)

        answer, root = asyncio.run(call())
    finally:
        for x in reversed(made):
            x.stop()
    assert answer.startswith("HI / ")
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}  # one trace

    def child(parent: ReadableSpan, name: str) -> ReadableSpan:
        kids = [s for s in spans if s.name == name and s.parent is not None
                and s.parent.span_id == parent.context.span_id]
        assert len(kids) == 1, (parent.name, name, [(s.name, s.parent) for s in spans])
        return kids[0]

    hop1 = child(root, "chains.call")
    assert hop1.attributes["tripod.chainlet"] == "Outer" and hop1.attributes["tripod.caller"] == "client"
    outer_req = child(hop1, "chains.request")
    hop2 = child(outer_req, "chains.call")
    assert hop2.attributes["tripod.chainlet"] == "Inner" and hop2.attributes["tripod.caller"] == "Outer"
    inner_req = child(hop2, "chains.request")
    assert inner_req.attributes["tripod.component"] == "chains"
    # The LLM call was made inside the outer worker's request: its traceparent names that span.
    _, trace_id, parent_id, _ = llm.headers[-1]["traceparent"].split("-")
    assert int(trace_id, 16) == root.context.trace_id and int(parent_id, 16) == outer_req.context.span_id
