"""``tripod route`` (a router in front of given replicas) and ``tripod serve --replicas`` (a router
plus a supervisor that launches the replicas). Both drain on SIGTERM/SIGINT: new requests get 503,
in-flight answers finish, then (fleet) every replica drains and exits.

Exit codes: 0 after a clean stop; 2 when start-up failed (port in use, no replica ever healthy).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn

from tripod import tracing
from tripod.asgi import DrainingServer
from tripod.config import FleetConfig, RouterConfig
from tripod.fleet.replicas import LocalLauncher, ReplicaLauncher, RoleLauncher
from tripod.fleet.supervisor import Supervisor
from tripod.router.app import build_router_app, make_router_gate
from tripod.router.proxy import trust_replica_ca
from tripod.router.replica import parse_replica
from tripod.router.router import Router
from tripod.tenants import TenantFileError, TenantGate

log = logging.getLogger("tripod.router")


def _run(router: Router, app: Any, config: RouterConfig, log_level: int, drain_timeout: float) -> bool:
    logging.getLogger("httpx").setLevel(max(log_level, logging.WARNING))  # not a line per probe
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=logging.getLevelName(log_level).lower(),
                        access_log=False, timeout_graceful_shutdown=max(1, int(drain_timeout)), lifespan="on",
                        timeout_keep_alive=30, ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile)

    def on_signal(sig: signal.Signals) -> None:
        if not router.draining:
            log.info("%s: draining (%d requests in the router), then exiting", sig.name, router.pending)
            router.draining = True

    server = DrainingServer(uv, on_signal)
    try:
        server.run()
    except SystemExit:  # uvicorn's own exit when start-up failed (the reason is logged): ours is 2
        return False
    finally:
        tracing.shutdown()  # the spans still buffered go out
    return bool(server.started)


def _tenants(router: Router) -> TenantGate | None:
    """The router's tenants and trust in replicas' certificates (and its tracing), or None (the
    reason printed: exit 2) for an invalid tenants file, audit log path or CA bundle, or tracing
    that cannot start."""
    cfg = router.config
    try:
        trust_replica_ca(cfg.ssl_ca)
        tracing.configure("tripod-router", cfg.otel_endpoint, cfg.otel_file)
        return make_router_gate(router)
    except (TenantFileError, OSError, ssl.SSLError, tracing.TracingUnavailable) as e:
        print(f"tripod: error: {e}", file=sys.stderr)
        return None


def _scheme(config: RouterConfig) -> str:
    return "https" if config.ssl_certfile else "http"


def route(config: RouterConfig, urls: list[str], log_level: int = logging.INFO, drain_timeout: float = 30.0) -> int:
    """Serve a router in front of running replicas given by URL."""
    if not urls:
        print("tripod: error: give at least one --replica URL", file=sys.stderr)
        return 2
    router = Router(config)
    gate = _tenants(router)
    if gate is None:
        return 2
    for i, spec in enumerate(urls):
        try:
            url, labels = parse_replica(spec)  # URL[,region=NAME,...]
        except ValueError as e:
            print(f"tripod: error: {e}", file=sys.stderr)
            return 2
        if not url.startswith(("http://", "https://")):
            print(f"tripod: error: --replica must be an http(s) URL (got {url!r})", file=sys.stderr)
            return 2
        router.add_replica(f"replica-{i}", url, labels=labels)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await router.start()
        log.info("routing %s over %d replicas at %s://%s:%d/v1 (%d routable now)", config.policy, len(urls),
                 _scheme(config), config.host, config.port, len(router.routable()))
        try:
            yield
        finally:
            await router.stop()

    return 0 if _run(router, build_router_app(router, lifespan, gate=gate), config, log_level, drain_timeout) else 2


def make_launcher(fleet: FleetConfig, serve_args: list[str], log_dir: Path | None) -> ReplicaLauncher:
    if fleet.backend == "ray":
        from tripod.fleet.ray_backend import RayLauncher

        return RayLauncher(serve_args, address=fleet.ray_address, num_cpus=fleet.ray_num_cpus,
                           num_gpus=fleet.ray_num_gpus)
    if fleet.prefill_replicas:
        return RoleLauncher(serve_args, fleet.prefill_replicas, log_dir=log_dir)
    return LocalLauncher(serve_args, log_dir=log_dir)


def serve_fleet(config: RouterConfig, fleet: FleetConfig, serve_args: list[str], log_level: int = logging.INFO,
                log_dir: Path | None = None) -> int:
    """A router on ``config.host:port`` and ``fleet.min_replicas`` replicas (more under load).

    Tenants: the router authenticates, enforces every limit across the replicas (the token limits
    and max_context with counts a replica makes: ``router/tenant_limits.py``) and writes the audit
    log; each replica gets the tenants file too (``serve_args``) with ``--tenant-limits none``: it
    attributes requests to the same tenants (its per-tenant series, the engine's fair share) and
    leaves the limits to the router. TLS: the router serves HTTPS to clients; replicas listen on
    loopback in plain HTTP."""
    if config.tenants:
        serve_args = [*serve_args, "--tenant-limits", "none"]  # NOTE: argparse keeps the last value
    try:
        launcher = make_launcher(fleet, serve_args, log_dir)
    except ValueError as e:
        print(f"tripod: error: {e}", file=sys.stderr)
        return 2
    router = Router(config)
    gate = _tenants(router)
    if gate is None:
        return 2
    supervisor = Supervisor(router, launcher, fleet)
    failed = False

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        nonlocal failed
        await router.start()
        await supervisor.start()
        try:
            # --min-replicas 0: nothing to wait for; the first request is held while one starts.
            if fleet.min_replicas > 0 and not await supervisor.wait_routable(fleet.start_timeout):
                failed = True
                why = supervisor.fatal or f"no replica became healthy in {fleet.start_timeout:.0f} s"
                raise RuntimeError(why + (f" (replica logs in {log_dir})" if log_dir else ""))
            log.info("fleet ready: %d replica(s) (%s backend, %s routing) at %s://%s:%d/v1, pid %d",
                     len(router.routable()), fleet.backend, config.policy, _scheme(config), config.host, config.port,
                     os.getpid())
            yield
        finally:
            await supervisor.stop()
            await router.stop()

    app = build_router_app(router, lifespan, fleet_info=supervisor.info, supervisor=supervisor, gate=gate)
    started = _run(router, app, config, log_level, fleet.drain_timeout)
    return 2 if failed or not started else 0
