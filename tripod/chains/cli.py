"""``tripod chains``: the command line of the workflow layer.

- ``tripod chains serve FILE.py [--entrypoint NAME] [--port P] [--model NAME=PATH|URL ...]``:
  serve a chain (see ``tripod.chains.chain_server`` and ``tripod.chains.chain_app``).
- ``tripod chains worker ...``: one chainlet replica; launched by ``serve``, not by hand.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
from pathlib import Path

from tripod.config import CHAINS_SERVE, FleetConfig, RouterConfig, ServerConfig
from tripod.config_cli import CommandParser, Subcommands, namespace_values

_NAMED = re.compile(r"^([A-Za-z0-9_.\-]+)=(.*)$", re.S)


def add_parser(sub: Subcommands) -> None:
    chains = sub.add_parser("chains", help="workflows: serve a chain of chainlets and models (tripod chains serve FILE.py)",
                            description="Multi-step, multi-model pipelines written as typed Python (tripod.chains).")
    chains.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    csub = chains.add_subparsers(dest="chains_command")
    srv = csub.add_parser("serve", help="serve a chain: each chainlet its own processes, each model a tripod fleet")
    srv.add_argument("file", help="the chain's Python file")
    srv.add_argument("--entrypoint", default=None, help="the chainlet to serve at /run (default: the one marked "
                     "@chains.entrypoint)")
    srv.add_argument("--model", action="append", default=[], metavar="NAME=PATH|URL",
                     help="serve model NAME from a .gguf file or HF folder (empty: the embedded model) with a fleet, "
                     "or route it to a running OpenAI-compatible server at URL; overrides the file's chains.Model")
    srv.add_argument("--model-args", action="append", default=[], metavar="[NAME=]ARGS",
                     help="more `tripod serve` options for every model's replicas, or for NAME's only "
                     "(e.g. --model-args='--dtype float32 --threads 1'; repeatable)")
    srv.add_argument("--log-dir", default=None, help="write each replica's log under this folder")
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    # The options shared with tripod serve/route, declared once on their configs.
    CommandParser(srv, CHAINS_SERVE).add(ServerConfig, None).add(FleetConfig, None).add(RouterConfig, None)

    wrk = csub.add_parser("worker", help="(internal) one chainlet replica, as launched by `tripod chains serve`")
    wrk.add_argument("--file", required=True, help="the chain's Python file")
    wrk.add_argument("--chainlet", required=True, help="the chainlet this process serves")
    wrk.add_argument("--entrypoint", default=None, help="the chain's entrypoint (default: the marked one)")
    wrk.add_argument("--server", required=True, help="the chain server's URL (replica lists, the models)")
    wrk.add_argument("--host", default="127.0.0.1", help="address to listen on")
    wrk.add_argument("--port", type=int, required=True, help="port to listen on")
    wrk.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish the calls in flight on SIGTERM")
    wrk.add_argument("--otel-endpoint", default=None, help="as tripod chains serve's")
    wrk.add_argument("--otel-file", default=None, help="as tripod chains serve's")
    wrk.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")


def parse_models(items: list[str]) -> dict[str, str]:
    """``--model NAME=PATH|URL ...`` → {name: path or URL}."""
    out = {}
    for item in items:
        m = _NAMED.match(item)
        if m is None:
            raise ValueError(f"--model takes NAME=PATH or NAME=URL (got {item!r})")
        out[m.group(1)] = m.group(2)
    return out


def parse_model_args(items: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``--model-args [NAME=]ARGS ...`` → (options for every model's replicas, {name: options for its own})."""
    common: list[str] = []
    by: dict[str, list[str]] = {}
    for item in items:
        m = _NAMED.match(item)
        if m is not None and not item.startswith("-"):
            by.setdefault(m.group(1), []).extend(shlex.split(m.group(2)))
        else:
            common.extend(shlex.split(item))
    return common, by



def main(args: argparse.Namespace) -> int:
    if args.chains_command == "worker":
        from tripod.chains import worker

        return worker.main(args)
    if args.chains_command != "serve":
        raise ValueError("tripod chains needs a command: serve (see tripod chains serve --help)")
    from tripod.chains.chain_app import serve_chain
    from tripod.chains.chain_server import ChainServeConfig

    common, by = parse_model_args(args.model_args)
    # ChainServeConfig's fields are named as the shared options' dests (host, port, backend, ray_*,
    # router_policy, start_timeout, drain_timeout).
    shared = namespace_values(args, CHAINS_SERVE, ServerConfig, FleetConfig, RouterConfig)
    cfg = ChainServeConfig(
        file=args.file, entrypoint=args.entrypoint, models=parse_models(args.model), model_args=common, model_args_by=by,
        log_dir=Path(args.log_dir) if args.log_dir else None, log_level=str(args.log_level).upper(), **shared,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return serve_chain(cfg)
