"""``chains.run_local()``: a whole chain in this process, for tests and notebooks.

    with chains.run_local(models={"judge": "http://127.0.0.1:8000"}):
        essay = await Writer().run(topic="tides")

Each chainlet class gets one instance (built on first use, dependencies injected); every call
between chainlets goes through the same boundary as when served (arguments and answers validated
and passed as JSON-shaped data, retries, timeouts that cancel the callee), without the network.
LLMs are reached over HTTP: ``models`` maps each model name to a URL (or an ``Endpoint``); a model
left out is looked up in its ``chains.Model(url=...)`` declaration, else, with
``launch_models=True``, served by a ``tripod serve`` started here (and stopped on exit).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

from tripod.chains.core import (
    Chainlet,
    Dependency,
    LLMSpec,
    Model,
    Runtime,
    entrypoint_options,
    signature,
)
from tripod.chains.errors import ChainError
from tripod.chains.llm_client import ClientPool, Endpoint, LLMClient
from tripod.chains.metrics import ChainMetrics
from tripod.chains.runtime import Handle, LocalHandle

log = logging.getLogger("tripod.chains")


class LocalRuntime(Runtime):
    def __init__(self, models: Mapping[str, str | Endpoint] | None = None, *, launch_models: bool = False,
                 model_args: tuple[str, ...] = ("--dtype", "float32"), llm_timeout: float = 600.0) -> None:
        self.metrics = ChainMetrics()
        self.endpoints: dict[str, Endpoint] = {k: v if isinstance(v, Endpoint) else Endpoint(v)
                                               for k, v in (models or {}).items()}
        self.launch_models = launch_models
        self.model_args = tuple(model_args)
        self.instances: dict[type[Chainlet], Chainlet] = {}
        self._building: list[type[Chainlet]] = []
        self._clients = ClientPool(llm_timeout)
        self._token: contextvars.Token[Runtime | None] | None = None
        self._launched: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
        self._closing: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ context
    def __enter__(self) -> LocalRuntime:
        if self._token is not None:
            raise ChainError("this run_local() context is already active")
        self._token = self.activate()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        assert self._token is not None
        self.deactivate(self._token)
        self._token = None
        self._stop_launched()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        # A plain `with` inside async code: close this loop's LLM connections soon after.
        task = loop.create_task(self._clients.aclose())
        self._closing = task  # NOTE: held so the loop's weak reference does not drop it

    async def __aenter__(self) -> LocalRuntime:
        return self.__enter__()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._clients.aclose()
        self.__exit__(et, e, tb)
        if self._closing is not None:
            await self._closing

    # ------------------------------------------------------------ Runtime
    def instance(self, cls: type[Chainlet]) -> Chainlet:
        """The chain's one instance of ``cls`` (built, with its dependencies, on first use)."""
        inst = self.instances.get(cls)
        if inst is not None:
            return inst
        if cls in self._building:
            trail = [c.__name__ for c in self._building[self._building.index(cls):]] + [cls.__name__]
            raise ChainError(f"the chain has a cycle: {' → '.join(trail)}")
        self._building.append(cls)
        token = self.activate()  # build in this context even when called from outside it
        try:
            inst = cls()
        finally:
            self.deactivate(token)
            self._building.pop()
        self.instances[cls] = inst
        return inst

    def dependency(self, dep: Dependency, caller: type[Chainlet]) -> Handle:
        return LocalHandle(dep, caller.__name__, self.metrics, self.instance(dep.cls))

    def handle(self, cls: type[Chainlet], caller: str = "client") -> Handle:
        """A handle to the chain's instance of ``cls`` as a client would call it: arguments and
        answer validated, the entrypoint's ``retries``/``timeout_s`` applied."""
        signature(cls)
        opts = entrypoint_options(cls)
        dep = Dependency(cls, opts.retries, opts.timeout_s, opts.replicas)
        return LocalHandle(dep, caller, self.metrics, self.instance(cls))

    def llm(self, spec: LLMSpec, caller: type[Chainlet]) -> LLMClient:
        return LLMClient(self._endpoint(spec.model, spec.declared), spec.model, spec.defaults, self._clients)

    def _endpoint(self, name: str, declared: Model | None) -> Endpoint:
        ep = self.endpoints.get(name)
        if ep is None and declared is not None and declared.url:
            ep = self.endpoints[name] = Endpoint(declared.url)
        if ep is None and self.launch_models:
            ep = self.endpoints[name] = self._launch(name, declared)
        if ep is None:
            raise ChainError(f"run_local() has no endpoint for the model {name!r}: pass models={{{name!r}: "
                             "'http://host:port'}} (any OpenAI-compatible server, e.g. `tripod serve`), or "
                             "launch_models=True to start a tripod server for it here")
        return ep

    def _launch(self, name: str, declared: Model | None) -> Endpoint:
        from tripod.fleet.process import free_port, spawn_serve, wait_healthy

        port = free_port()
        args = [*self.model_args, *(declared.args if declared else ()), "--served-model-name", name]
        if declared is not None and declared.path:
            args += ["--model", declared.path]
        path = Path(tempfile.gettempdir()) / f"tripod-run-local-{name}-{port}.log"
        logf = open(path, "ab")  # closed in _stop_launched
        proc = spawn_serve("127.0.0.1", port, args, logf)
        self._launched.append((proc, logf))
        url = f"http://127.0.0.1:{port}"
        log.info("run_local: serving model %r at %s (log: %s)", name, url, path)
        why = wait_healthy(url, [proc], 300.0)
        if why is not None:
            raise ChainError(f"the tripod server for model {name!r} {why}; see {path}")
        return Endpoint(url)

    def _stop_launched(self) -> None:
        for proc, logf in self._launched:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            logf.close()
        self._launched.clear()

    async def aclose(self) -> None:
        await self._clients.aclose()


def run_local(models: Mapping[str, str | Endpoint] | None = None, *, launch_models: bool = False,
              model_args: tuple[str, ...] = ("--dtype", "float32"), llm_timeout: float = 600.0) -> LocalRuntime:
    """A chain context in this process (use with ``with`` or ``async with``); see the module doc."""
    if os.environ.get("TRIPOD_CHAINS_MODELS") and not models:
        # "name=url,name=url": lets a test or a notebook point a chain at running models.
        models = dict(kv.split("=", 1) for kv in os.environ["TRIPOD_CHAINS_MODELS"].split(",") if "=" in kv)
    return LocalRuntime(models, launch_models=launch_models, model_args=model_args, llm_timeout=llm_timeout)
