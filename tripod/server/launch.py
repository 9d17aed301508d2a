"""``tripod serve``: start the engine process, then serve HTTP until told to stop.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT: stop accepting, let in-flight requests finish
up to ``drain_timeout``); 1 when the engine process died or hung (a supervisor should restart
us); 2 when start-up failed (bad model, port in use, an invalid tenants file: the line and the reason).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import uvicorn

from tripod import tracing
from tripod.asgi import DrainingServer
from tripod.config import EngineConfig, ServerConfig
from tripod.config_services import check_pd_role
from tripod.loader import load_tokenizer
from tripod.server.answer.text import TextSide
from tripod.server.app import build_app, lifespan_for
from tripod.server.engine_client import EngineClient
from tripod.server.media.loader import ImageLoader
from tripod.server.media.vision import VisionSide
from tripod.server.metrics import ServerMetrics
from tripod.server.response_store import ResponseStore, StoreError
from tripod.server.state import ServerState, make_gate, make_store
from tripod.tenants import TenantFileError, TenantGate

log = logging.getLogger("tripod.server")

PRIVATE_TIER_GB = 1.0  # --role decode without --kv-disk: the private tier's capacity at most


def serve(engine_config: EngineConfig, config: ServerConfig, log_level: int = logging.INFO) -> int:
    """Run the server until it is stopped; returns the process exit code."""
    metrics = ServerMetrics(config.served_model_name or "")
    try:
        check_pd_role(config.role, engine_config.enable_prefix_cache, engine_config.world_size)
    except ValueError as e:
        print(f"tripod: error: {e}", file=sys.stderr)
        return 2
    private: str | None = None
    if config.role == "decode" and engine_config.kv_disk is None:
        # A decode replica receives prompts' KV into a disk tier: a private one in memory (tmpfs) when
        # none is given, at most PRIVATE_TIER_GB, removed at exit.
        private = tempfile.mkdtemp(prefix="tripod-pd-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        engine_config = replace(engine_config, kv_disk=private,
                                kv_disk_size=min(engine_config.kv_disk_size, PRIVATE_TIER_GB))
        log.info("--role decode: receiving KV into a private tier at %s (%.1f GB)", private,
                 engine_config.kv_disk_size)
    try:
        gate = make_gate(config, metrics)  # a bad tenants file is refused before the engine starts
        store = make_store(config)  # so is a foreign or corrupt --responses-store file
        # NOTE: before the engine is spawned: it reports its times only when tracing is on.
        tracing.configure("tripod-server", config.otel_endpoint, config.otel_file)
    except (TenantFileError, StoreError, OSError, tracing.TracingUnavailable) as e:
        print(f"tripod: error: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(engine_config, config, log_level, metrics, gate, store)
    finally:
        store.close()
        tracing.shutdown()  # the spans still buffered go out
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def load_vision(path: str, config: ServerConfig, text: TextSide) -> VisionSide | None:
    """The image side of the checkpoint at ``path``: its own processor (``tripod.loader.multimodal``,
    offline) and the image loader under ``config``'s limits; None for a text-only checkpoint."""
    from tripod.loader.multimodal import VisionProcessor

    folder = Path(path)
    processor = VisionProcessor.from_folder(folder) if folder.is_dir() else None
    if processor is None:
        return None
    if not text.template and processor.chat_template:  # (a processor's chat_template.json)
        text.tokenizer.chat_template = processor.chat_template
    hosts = ", ".join(config.media_hosts) or "none (data: URLs only)"
    log.info("images: %s processor, up to %d per request, %d bytes and %d pixels each; image URLs fetched from: %s",
             processor.family, config.limit_mm_per_prompt, config.max_image_bytes, config.max_image_pixels, hosts)
    return VisionSide(processor, ImageLoader(config))


def _serve(engine_config: EngineConfig, config: ServerConfig, log_level: int, metrics: ServerMetrics,
           gate: TenantGate, store: ResponseStore) -> int:
    client = EngineClient(engine_config, config, log_level)
    client.spawn()  # the engine loads the weights while we load the tokenizer
    try:
        tok = load_tokenizer(engine_config.model)
        text = TextSide(tok.tokenizer, tok.config.vocab_size)
        vision = load_vision(tok.path, config, text)
    except (ValueError, FileNotFoundError) as e:
        client.abandon()
        print(f"tripod: error: {e}", file=sys.stderr)
        return 2
    name = config.served_model_name or tok.name
    metrics.model_name = name
    state = ServerState(
        engine_config=engine_config, config=config, text=text,
        client=client, model_name=name, quantization=tok.quantization, metrics=metrics, gate=gate,
        architecture=tok.config.architecture, store=store, vision=vision,
    )
    if state.reasoning is not None:
        log.info("reasoning parser: %s (--reasoning-parser %s)", state.reasoning.name, config.reasoning_parser)
    client.on_heartbeat = metrics.on_heartbeat
    app = build_app(state, lifespan=lambda _app: lifespan_for(state))
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=logging.getLevelName(log_level).lower(),
        access_log=False, timeout_graceful_shutdown=int(config.drain_timeout) or 1,
        lifespan="on", timeout_keep_alive=30, ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile,
    )

    def on_signal(sig: signal.Signals) -> None:
        if not state.draining:
            log.info("%s: draining (%d sequences in flight, up to %.0f s), then exiting",
                     sig.name, client.inflight, config.drain_timeout)
            state.draining = True

    server = DrainingServer(uv_config, on_signal)

    def on_death(reason: str) -> None:
        state.exit_code = 1
        # NOTE: /health answers 503 during the grace period, then the port closes and we exit 1.
        asyncio.get_running_loop().call_later(config.dead_grace, lambda: setattr(server, "should_exit", True))

    client.on_death = on_death
    server.run()
    if client.info is None:  # the engine never came up (its error is in the log above)
        return 2
    if not server.started and state.exit_code == 0:
        return 2  # could not bind the port
    if state.exit_code:
        log.error("exiting with code %d: %s", state.exit_code, client.dead_reason)
    return state.exit_code
