"""The ``tripod`` command line.

- ``tripod serve``: the OpenAI-compatible server (HTTP process + engine process).
- ``tripod serve --replicas N`` (or ``--min-replicas A --max-replicas B``): a fleet — a router on
  --host/--port in front of N replica servers it launches, restarts and scales.
- ``tripod route --replica URL ...``: a router in front of servers that already run.
- ``tripod chat``: a streaming terminal chat, against a running server (``--url``) or an
  in-process engine.
- ``tripod generate "prompt"``: one streamed completion offline; with no prompt, the same chat.
- ``tripod chains serve FILE.py``: a chain of chainlets and models as one service (``tripod.chains``).

Dispatch only: every option that sets a config is declared once, on its field in ``tripod.config``
(``opt(...)``); ``tripod.config_cli`` adds it to each command that takes it, reads the configs back,
and writes what a fleet forwards to its replicas. Declared here: what belongs to one command alone
(a prompt, --url, --replica, the fleet's size).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from tripod.chat import LocalChat, RemoteChat, chat_loop, stream_answer
from tripod.config import (
    CHAT,
    GENERATE,
    ROUTE,
    SERVE,
    EngineConfig,
    FleetConfig,
    RouterConfig,
    SamplingOptions,
    ServerConfig,
)
from tripod.config_cli import CommandParser, Subcommands, from_namespace, to_argv
from tripod.config_services import check_pd_role

if TYPE_CHECKING:
    from tripod.engine.engine import Engine
    from tripod.engine.request import SamplingParams


def _log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")


def _add_generate(sub: Subcommands) -> None:
    gen = sub.add_parser("generate", help="generate text offline (no server); no prompt = interactive chat")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt; omit for an interactive chat")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="system message for chat mode")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image to ask about (a vision-language model; repeat for several, in order)")
    gen.add_argument("--stats", action="store_true", help="print token counts and speed after each answer")
    _log_level(gen)
    CommandParser(gen, GENERATE).add(EngineConfig, "engine").add(SamplingOptions, "sampling")


def _add_serve(sub: Subcommands) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI API (default: the embedded SmolLM2 on 127.0.0.1:8000)")
    _log_level(srv)
    cp = CommandParser(srv, SERVE, groups=("engine", "server", "fleet", "router", "console"))
    cp.add(EngineConfig, "engine").add(ServerConfig, "server")
    fleet = cp.group("fleet")
    fleet.add_argument("--replicas", type=int, default=None, help="run N replicas behind a router on --host/--port")
    fleet.add_argument("--min-replicas", type=int, default=None,
                       help="autoscale between --min-replicas and --max-replicas")
    fleet.add_argument("--max-replicas", type=int, default=None, help="see --min-replicas")
    fleet.add_argument("--prefill-replicas", type=int, default=None, metavar="P",
                       help="prefill/decode disaggregation: P more replicas run --role prefill and the --replicas N "
                       "run --role decode; the router has prompts prefilled on the former and answered by the latter")
    cp.add(FleetConfig, "fleet")
    fleet.add_argument("--replica-log-dir", default=None, help="local: write each replica's log here")
    cp.add(RouterConfig, "router")


def _add_route(sub: Subcommands) -> None:
    rte = sub.add_parser("route", help="route the OpenAI API over running servers (--replica URL ...)")
    rte.add_argument("--replica", action="append", default=[], metavar="URL", help="a server; repeat for each")
    _log_level(rte)
    CommandParser(rte, ROUTE).add(ServerConfig, None).add(RouterConfig, "router")


def _add_chat(sub: Subcommands) -> None:
    chat = sub.add_parser("chat", help="chat in the terminal, with a server (--url) or an in-process engine")
    chat.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: in-process)")
    chat.add_argument("--api-key", default=os.environ.get("TRIPOD_API_KEY"), help="for --url (default: $TRIPOD_API_KEY)")
    chat.add_argument("--system", default=None, help="system message")
    _log_level(chat)
    CommandParser(chat, CHAT).add(EngineConfig, "engine").add(SamplingOptions, "sampling")


def _add_bench(sub: Subcommands) -> None:
    from tripod.bench.main import add_arguments

    bench = sub.add_parser("bench", help="benchmark servers: throughput vs interactivity (see --help)",
                           description="Measure tripod and any OpenAI-compatible server side by side. "
                           "'tripod bench compare DIR...' overlays earlier runs.")
    bench.add_argument("action", nargs="?", default="run", choices=["run", "compare"])
    bench.add_argument("dirs", nargs="*", help="compare: result folders to overlay")
    _log_level(bench)
    add_arguments(bench)


def build_parser() -> argparse.ArgumentParser:
    from tripod.chains.cli import add_parser as add_chains_parser

    parser = argparse.ArgumentParser(prog="tripod", description="tripod: mission-critical LLM inference")
    parser.add_argument("--log-level", default=os.environ.get("TRIPOD_LOG_LEVEL", "INFO"))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    for add in (_add_generate, _add_serve, _add_route, _add_chat, _add_bench, add_chains_parser):
        add(sub)
    return parser


def _make_engine(args: argparse.Namespace) -> Engine:
    from tripod.engine.engine import Engine

    return Engine(config=from_namespace(EngineConfig, args))


def _params(args: argparse.Namespace) -> SamplingParams:
    from tripod.engine.request import SamplingParams

    return SamplingParams(**asdict(from_namespace(SamplingOptions, args)))


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _params(args)
    if args.image and (args.prompt is None or args.raw):
        raise ValueError("--image asks about images in a chat prompt: give the prompt, without --raw")
    if args.prompt is not None:
        if args.raw:
            prompt: Any = args.prompt
        else:
            parts: Any = args.prompt
            if args.image:
                parts = [*({"type": "image"} for _ in args.image), {"type": "text", "text": args.prompt}]
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": parts}
            ]
            prompt = engine.image_prompt(msgs, _images(args.image)) if args.image else engine.apply_chat_template(msgs)
        stream_answer(engine, prompt, params, args.stats)
        return 0
    return chat_loop(LocalChat(engine, params), args.system)


def _images(paths: list[str]) -> list[Any]:
    from PIL import Image, UnidentifiedImageError

    from tripod.loader.multimodal import to_rgb

    out = []
    for path in paths:
        try:
            with Image.open(path) as im:
                out.append(to_rgb(im).copy())  # (a copy: the file closes)
        except (OSError, UnidentifiedImageError) as err:
            raise ValueError(f"--image {path}: not a readable image ({err})") from err
    return out


def cmd_chat(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one log line per turn is noise here
    if args.url:
        return chat_loop(RemoteChat(args.url, args.api_key, from_namespace(SamplingOptions, args)), args.system)
    return chat_loop(LocalChat(_make_engine(args), _params(args)), args.system)


def cmd_bench(args: argparse.Namespace) -> int:
    from tripod.bench import main as bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.action == "compare":
        if not args.dirs:
            raise ValueError("tripod bench compare needs result folders: tripod bench compare DIR1 DIR2 ...")
        return bench.compare(args.dirs, args.out)
    if args.dirs:
        raise ValueError(f"unexpected arguments {args.dirs}; did you mean 'tripod bench compare'?")
    return bench.run(args)


def replica_argv(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """The ``tripod serve`` options of a fleet's replica, written from the configs they parse back
    into: every engine and server option but --host/--port (each replica's own) and --bench-dir
    (the router serves the console). An option declared on EngineConfig or ServerConfig reaches
    the replicas with no list to keep in step."""
    return [*to_argv(engine, SERVE), *to_argv(server, SERVE)]


def replica_args(args: argparse.Namespace, threads: int | None) -> list[str]:
    """A fleet replica's whole ``tripod serve`` command line (but --host/--port): ``tripod serve``'s
    own options, with ``threads`` torch threads and this process's log level."""
    engine = replace(from_namespace(EngineConfig, args), num_threads=threads)
    return [*replica_argv(engine, from_namespace(ServerConfig, args)), "--log-level", str(args.log_level)]


def cmd_fleet(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tripod.fleet.launch import serve_fleet

    # The replicas' engine options are checked once, here: a bad value (--num-draft-tokens 0) is
    # one clear exit 2 rather than every replica failing to start.
    from_namespace(EngineConfig, args)
    lo = args.min_replicas if args.min_replicas is not None else (args.replicas or 1)
    hi = args.max_replicas if args.max_replicas is not None else (args.replicas or lo)
    prefill = args.prefill_replicas or 0
    try:
        fleet = from_namespace(FleetConfig, args, min_replicas=lo + prefill, max_replicas=hi + prefill,
                               prefill_replicas=prefill, drain_timeout=args.drain_timeout)
        if args.role != "both":
            raise ValueError("--role is one replica's: a fleet gives its replicas their roles (--prefill-replicas P)")
        if prefill:
            check_pd_role("prefill", args.enable_prefix_cache, from_namespace(EngineConfig, args).world_size)
            if args.backend != "local":
                raise ValueError("--prefill-replicas runs local replicas only for now (drop --backend ray)")
    except ValueError as e:
        print(f"tripod: error: {e}", file=sys.stderr)
        return 2
    hi += prefill
    threads = args.num_threads
    if threads is None and args.backend == "local" and args.device == "cpu":
        threads = max(1, (os.cpu_count() or 1) // hi)  # replicas share this machine's cores
    log_dir = Path(args.replica_log_dir) if args.replica_log_dir else None
    return serve_fleet(from_namespace(RouterConfig, args), fleet, replica_args(args, threads), _level(args), log_dir)


def cmd_route(args: argparse.Namespace) -> int:
    from tripod.fleet.launch import route

    return route(from_namespace(RouterConfig, args), args.replica, _level(args), args.drain_timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    from tripod.server.launch import serve

    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None \
            or args.backend != "local" or args.prefill_replicas is not None:
        return cmd_fleet(args)
    from tripod.loader.weights_mode import resolve_weights

    cfg = from_namespace(ServerConfig, args)
    # --weights auto resolved here, so the server reports (and the engine process runs) the same mode.
    return serve(resolve_weights(from_namespace(EngineConfig, args)), cfg, _level(args))


def _level(args: argparse.Namespace) -> int:
    level: int = getattr(logging, str(args.log_level).upper(), logging.INFO)
    return level


def cmd_chains(args: argparse.Namespace) -> int:
    from tripod.chains.cli import main as chains_main

    return chains_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from tripod import __version__

        print(f"tripod {__version__}")
        return 0
    logging.basicConfig(
        level=_level(args),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    commands = {"generate": cmd_generate, "serve": cmd_serve, "route": cmd_route, "chat": cmd_chat, "bench": cmd_bench,
                "chains": cmd_chains}
    if args.command in commands:
        try:
            return commands[args.command](args)
        except (ValueError, FileNotFoundError) as e:
            print(f"tripod: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
