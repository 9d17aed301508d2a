"""A real ``tripod serve`` inside the test process: the server's app (``build_app``) served by
uvicorn in a thread, its engine a real engine process on the embedded model. For tests that need
to see what the HTTP process does from inside (e.g. its spans, with an in-memory exporter)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from tests.router.stubs import ServerThread
from tripod.config import EngineConfig, ServerConfig
from tripod.loader import load_tokenizer
from tripod.server.answer.text import TextSide
from tripod.server.app import build_app, lifespan_for
from tripod.server.engine_client import EngineClient
from tripod.server.metrics import ServerMetrics
from tripod.server.state import ServerState, make_gate

START_TIMEOUT = 180.0
ENGINE = EngineConfig(dtype="float32", kernels="optimized", kv_cache_tokens=8192, num_threads=1)


class InProcessServer:
    """``tripod serve`` (engine ``engine``, server ``config``) on a free 127.0.0.1 port, in a thread."""

    def __init__(self, config: ServerConfig | None = None, engine: EngineConfig = ENGINE) -> None:
        config = config or ServerConfig()
        metrics = ServerMetrics("")
        gate = make_gate(config, metrics)
        client = EngineClient(engine, config, logging.WARNING)
        tok = load_tokenizer(engine.model)
        metrics.model_name = tok.name
        self.state = state = ServerState(
            engine_config=engine, config=replace(config), text=TextSide(tok.tokenizer, tok.config.vocab_size),
            client=client, model_name=tok.name, quantization=tok.quantization, metrics=metrics, gate=gate)
        client.on_heartbeat = metrics.on_heartbeat
        self.app: Any = build_app(state, lifespan=lambda _app: lifespan_for(state))
        # NOTE: the lifespan starts the engine (the model loads) before uvicorn reports started.
        self.server = ServerThread(self.app, graceful=2.0, start_timeout=START_TIMEOUT)
        self.url = self.server.url
        self.model = tok.name

    def stop(self) -> None:
        self.server.stop()
