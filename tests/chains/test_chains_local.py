"""tripod.chains in one process (``run_local``): the programming model and the boundary every
call crosses — typed validation, retries of retryable failures only, timeouts that cancel the
callee, streams that deliver items as they come, cancellation down the call tree, errors naming
the chainlet. No model and no process: these are fast."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

from tripod import chains
from tripod.chains.core import Graph
from tripod.router.merge import merge_pages


class Verdict(BaseModel):
    ok: bool
    score: int


class Critic(chains.Chainlet):
    async def run(self, draft: str, strict: bool = False) -> Verdict:
        return Verdict(ok=len(draft) > (10 if strict else 3), score=len(draft))


class Flaky(chains.Chainlet):
    """Fails ``fail`` times in a row (per instance), then answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, fail: int) -> int:
        self.calls += 1
        if self.calls <= fail:
            raise RuntimeError(f"flaky failure {self.calls}")
        return self.calls


class Sleeper(chains.Chainlet):
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = 0

    async def run(self, seconds: float) -> str:
        self.started.set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return "slept"


class Liar(chains.Chainlet):
    async def run(self) -> Verdict:
        return {"ok": "not a bool", "score": 1}  # type: ignore[return-value]


class Gate(chains.Chainlet):
    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.produced: list[int] = []

    async def run(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            if i == n - 1:
                await self.go.wait()  # the last item waits until the consumer has the first
            self.produced.append(i)
            yield i


@chains.entrypoint(retries=1)
class Writer(chains.Chainlet):
    def __init__(self, critic=chains.depends(Critic), flaky=chains.depends(Flaky, retries=2, backoff_s=0.001),
                 sleeper=chains.depends(Sleeper, timeout_s=0.2), gate=chains.depends(Gate, replicas=3),
                 liar=chains.depends(Liar, retries=3)):
        self.critic, self.flaky, self.sleeper, self.gate, self.liar = critic, flaky, sleeper, gate, liar

    async def run(self, topic: str, n: int = 3) -> list[Verdict]:
        return list(await asyncio.gather(*(self.critic.run(draft=topic * i) for i in range(n))))


def test_dependencies_are_injected_and_answers_typed() -> None:
    async def main() -> None:
        with chains.run_local() as chain:
            w = Writer()
            assert isinstance(w.critic, chains.Handle)
            out = await w.run(topic="tide", n=3)
            assert out == [Verdict(ok=False, score=0), Verdict(ok=True, score=4), Verdict(ok=True, score=8)]
            # One instance per chainlet class, shared by every caller in the chain.
            assert chain.instances[Critic] is w.critic.instance
            # Positional arguments are matched to parameters by name; JSON-shaped values coerce.
            assert await w.critic.run("abcd", "true") == Verdict(ok=False, score=4)
            assert chain.metrics.value("tripod:chainlet_calls_total", chainlet="Critic", outcome="ok") == 4

    asyncio.run(main())


def test_validation_errors_name_the_field_and_are_never_retried() -> None:
    async def main() -> None:
        with chains.run_local() as chain:
            w = Writer()
            with pytest.raises(chains.ChainletError) as e:
                await w.critic.run(draft=["not", "text"])
            err = e.value
            assert err.status == 400 and err.code == "invalid_arguments" and err.param == "draft"
            assert err.chainlet == "Critic" and "draft" in str(err) and not err.retryable
            with pytest.raises(chains.ChainletError) as e:
                await w.critic.run(draft="x", extra=1)
            assert e.value.param == "extra"
            # The entrypoint as a client calls it (retries=1): still one attempt for a 400.
            with pytest.raises(chains.ChainletError) as e:
                await chain.handle(Writer).run(topic="t", n="three")
            assert e.value.param == "n" and e.value.status == 400
            assert chain.metrics.value("tripod:chainlet_retries_total") == 0
            # A wrong answer is the callee's bug: a 500 naming it, not retried either (retries=3).
            with pytest.raises(chains.ChainletError) as e:
                await w.liar.run()
            assert e.value.code == "invalid_output" and e.value.chainlet == "Liar" and "ok" in str(e.value)
            assert chain.metrics.value("tripod:chainlet_dependency_calls_total", chainlet="Liar") == 1

    asyncio.run(main())


def test_retryable_failures_are_retried_then_reported() -> None:
    async def main() -> None:
        with chains.run_local() as chain:
            w = Writer()
            assert await w.flaky.run(fail=2) == 3  # two failures, retried twice: the third call answers
            assert chain.metrics.value("tripod:chainlet_retries_total", chainlet="Flaky", cause="chainlet_error") == 2
            w.flaky.instance.calls = 0
            with pytest.raises(chains.ChainletError) as e:
                await w.flaky.run(fail=5)
            err = e.value
            assert err.chainlet == "Flaky" and "RuntimeError: flaky failure 3" in str(err)
            assert "after 3 attempts" in str(err) and err.retryable
            assert chain.metrics.value("tripod:chainlet_failures_total", chainlet="Flaky") == 1

    asyncio.run(main())


def test_timeout_cancels_the_callee_and_says_so() -> None:
    async def main() -> None:
        with chains.run_local():
            w = Writer()
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(chains.ChainletError) as e:
                await w.sleeper.run(seconds=30)
            assert asyncio.get_running_loop().time() - t0 < 5
            assert e.value.code == "timeout" and e.value.chainlet == "Sleeper" and "0.2 s" in str(e.value)
            assert w.sleeper.instance.cancelled == 1

    asyncio.run(main())


def test_cancelling_the_caller_cancels_the_callee() -> None:
    async def main() -> None:
        with chains.run_local() as chain:
            sleeper = chain.handle(Sleeper)  # no timeout on this handle
            task = asyncio.ensure_future(sleeper.run(seconds=30))
            await sleeper.instance.started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sleeper.instance.cancelled == 1
            assert chain.metrics.value("tripod:chainlet_calls_total", chainlet="Sleeper", outcome="cancelled") == 1

    asyncio.run(main())


def test_a_stream_delivers_its_first_item_before_the_last_is_produced() -> None:
    async def main() -> None:
        with chains.run_local():
            w = Writer()
            got = []
            async for item in w.gate.run(n=3):
                got.append(item)
                if item == 0:
                    assert w.gate.instance.produced == [0]  # the last one is not produced yet
                    w.gate.instance.go.set()
            assert got == [0, 1, 2]

    asyncio.run(main())


def test_chain_mistakes_are_explained() -> None:
    with pytest.raises(chains.ChainError, match="run_local"):
        Writer()  # no chain context
    w = Writer(critic=None, flaky=None, sleeper=None, gate=None, liar=None)  # all passed: no context needed
    assert w.critic is None

    class A(chains.Chainlet):
        def __init__(self, b=chains.depends(Critic)):
            self.b = b

        async def run(self) -> None: ...

    with pytest.raises(chains.ChainError, match="cycle"):

        class Loop(chains.Chainlet):
            def __init__(self, me=None):
                self.me = me

            async def run(self) -> None: ...

        Loop.__init__.__tripod_original__.__defaults__ = (chains.depends(Loop),)  # type: ignore[attr-defined]
        Graph.build(Loop)
    with pytest.raises(chains.ChainError, match="Chainlet subclass"):
        chains.depends(int)
    with pytest.raises(chains.ChainError, match=r"\*args"):

        class Bad(chains.Chainlet):
            async def run(self, *xs: int) -> None: ...


def test_graph_replicas_and_models() -> None:
    class Judge(chains.Chainlet):
        llm = chains.llm(model="judge", temperature=0)

        async def run(self, text: str) -> str:
            return await self.llm.chat(text)

    @chains.entrypoint(replicas=2)
    class Top(chains.Chainlet):
        def __init__(self, j=chains.depends(Judge, replicas=3), j2=chains.depends(Judge), w=chains.depends(Writer)):
            self.j, self.j2, self.w = j, j2, w

        async def run(self) -> AsyncIterator[str]:
            yield "x"

    g = Graph.build(Top)
    assert g.nodes["Top"].replicas == 2 and g.nodes["Judge"].replicas == 3 and g.nodes["Gate"].replicas == 3
    assert set(g.nodes) == {"Top", "Judge", "Writer", "Critic", "Flaky", "Sleeper", "Gate", "Liar"}
    assert list(g.models()) == ["judge"]
    assert chains.signature(Top).streaming and chains.signature(Top).output_type is str
    with pytest.raises(chains.ChainError, match="judge"):

        async def use() -> None:
            with chains.run_local():
                await Judge().run(text="hi")

        asyncio.run(use())


def test_merged_metrics_pages_keep_every_replica() -> None:
    a, b = chains.ChainMetrics(), chains.ChainMetrics()
    a.calls.labels("C", "ok").inc()
    b.calls.labels("C", "ok").inc(2)
    page = merge_pages([({"replica": "a"}, a.render().decode()), ({"replica": "b"}, b.render().decode())]).decode()
    assert 'tripod:chainlet_calls_total{chainlet="C",outcome="ok",replica="a"} 1.0' in page
    assert 'tripod:chainlet_calls_total{chainlet="C",outcome="ok",replica="b"} 2.0' in page
    assert page.count("# TYPE tripod:chainlet_calls_total counter") == 1


def test_serve_command_line() -> None:
    from tripod.chains.cli import parse_model_args, parse_models
    from tripod.cli import build_parser

    args = build_parser().parse_args(["chains", "serve", "chain.py", "--model", "judge=/m/judge.gguf", "--model",
                                      "writer=", "--model", "ext=http://127.0.0.1:9/v1",
                                      "--model-args=--dtype float32 --threads 1",
                                      "--model-args", "judge=--kv-cache-tokens 4096", "--entrypoint", "Top"])
    assert args.chains_command == "serve" and args.file == "chain.py" and args.entrypoint == "Top"
    assert parse_models(args.model) == {"judge": "/m/judge.gguf", "writer": "", "ext": "http://127.0.0.1:9/v1"}
    assert parse_model_args(args.model_args) == (["--dtype", "float32", "--threads", "1"],
                                            {"judge": ["--kv-cache-tokens", "4096"]})
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_models(["judge"])
