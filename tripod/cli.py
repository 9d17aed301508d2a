"""The ``tripod`` command line.

- ``tripod serve``: the OpenAI-compatible server (HTTP process + engine process).
- ``tripod serve --replicas N`` (or ``--min-replicas A --max-replicas B``): a fleet — a router on
  --host/--port in front of N replica servers it launches, restarts and scales.
- ``tripod route --replica URL ...``: a router in front of servers that already run.
- ``tripod chat``: a streaming terminal chat, against a running server (``--url``) or an
  in-process engine.
- ``tripod generate "prompt"``: one streamed completion offline; with no prompt, the same chat.
- ``tripod chains serve FILE.py``: a chain of chainlets and models as one service (``tripod.chains``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or a local HF folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (CUDA only); auto = bfloat16 where native")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV budget in tokens (default: a fraction of free memory)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--chunk-size", type=int, default=256, help="longest prefill chunk per step")
    g.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward pass")
    g.add_argument("--max-running", type=int, default=128, help="requests decoding at once")
    g.add_argument("--policy", default="lpm", choices=["lpm", "fcfs"], help="waiting-queue order")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    # NOTE: kernels.build (no torch at import), not config (which imports torch): the CLI parses first.
    from tripod.kernels.build import LEVELS

    g.add_argument("--kernels", default="auto", choices=["auto", "eager", "optimized", *LEVELS],
                   help="compute path: auto = optimized for 16-bit dtypes (tripod's CPU kernels of the best "
                        "ISA level this CPU supports, built in the background on first use), the float32 "
                        "reference path for float32; eager = the reference path; optimized = tripod's "
                        "kernels in any dtype; avx2 / avx512 / avx512_bf16 = optimized on that level "
                        "(every level computes the same bits)")
    g.add_argument("--weights", default="dequantized", choices=["dequantized", "stored", "fp8"],
                   help="stored: execute a GGUF's Q4_1/Q8_0/Q5_0/Q4_K/Q6_K weights as stored (a quarter/half of "
                        "bf16's bytes per token, exactly the dequantized weights, float32 compute); "
                        "fp8: keep a block-wise FP8 checkpoint's weights in FP8 (w8a16)")
    g.add_argument("--no-jump-forward", action="store_true",
                   help="structured outputs: decode grammar-forced text token by token (outputs are identical either way)")
    g.add_argument("--speculative", default=None, type=_speculative, metavar="METHOD",
                   help="speculative decoding (lossless: outputs are those of plain decoding): ngram (prompt "
                        "lookup) | draft:PATH (a smaller model with the same tokenizer; draft:embedded) | self:K "
                        "(this model's first K layers as its draft), mtp (the checkpoint's multi-token-prediction "
                        "module: DeepSeek-V3); a request opts out with \"speculative\": false")
    g.add_argument("--num-draft-tokens", type=int, default=4, metavar="K",
                   help="speculative: most draft tokens per request per step (1-64)")
    g.add_argument("--spec-max-batch", type=int, default=8, metavar="B",
                   help="speculative: speculate only while at most B requests decode in a step (0: never)")


def _speculative(value: str) -> str:
    """``--speculative``'s type: checked at parse time (argparse's exit 2 with the reason), so a
    fleet refuses a bad method before it launches any replica."""
    from tripod.config import parse_speculative

    try:
        parse_speculative(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def _server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("TRIPOD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TRIPOD_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="sequences that may wait beyond --max-running before new requests are refused")
    g.add_argument("--overload-status", type=int, default=429, choices=[429, 503],
                   help="status for refused requests when the queue is full")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--max-n", type=int, default=16, help="largest 'n' a request may ask for")


def _router_args(p: argparse.ArgumentParser, policy_flag: str) -> None:
    g = p.add_argument_group("router")
    g.add_argument(policy_flag, dest="router_policy", default="cache_aware",
                   choices=["cache_aware", "least_load", "round_robin"], help="how a replica is picked")
    g.add_argument("--load-weight", type=float, default=1.0,
                   help="cache_aware: cost of one token of a replica's load vs one uncached prompt token")
    g.add_argument("--balance-abs", type=int, default=4, help="cache_aware guard: a replica with more than "
                   "balance-rel x (least in-flight) + balance-abs requests in flight is not chosen for its cache")
    g.add_argument("--balance-rel", type=float, default=1.5, help="see --balance-abs")
    g.add_argument("--max-retries", type=int, default=2,
                   help="other replicas tried when one fails before the answer starts; and continuations of an "
                   "answer (OpenAI chat/completions) on another replica when its replica fails mid-answer")
    g.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds an answer may go silent mid-way before its replica counts as failed (and the "
                   "answer is continued elsewhere)")
    g.add_argument("--max-pending", type=int, default=1024, help="requests the router holds before answering 429")
    g.add_argument("--queue-timeout", type=float, default=30.0,
                   help="longest wait for a routable replica before 503")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between health probes")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet (a router in front of replicas this process launches)")
    g.add_argument("--replicas", type=int, default=None, help="run N replicas behind a router on --host/--port")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale between --min-replicas and --max-replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="see --min-replicas")
    g.add_argument("--target-inflight", type=float, default=8.0,
                   help="autoscaler: requests in flight (+ queued) per replica it aims for")
    g.add_argument("--upscale-delay", type=float, default=10.0, help="seconds a wish to grow must hold")
    g.add_argument("--downscale-delay", type=float, default=60.0, help="seconds a wish to shrink must hold")
    g.add_argument("--lookback", type=float, default=30.0, help="seconds of load the autoscaler averages")
    g.add_argument("--backend", default="local", choices=["local", "ray"], help="where replicas run")
    g.add_argument("--ray-address", default=None, help="ray: 'auto' joins the running cluster (default: a local one)")
    g.add_argument("--ray-num-cpus", type=float, default=1.0, help="ray: CPUs each replica actor reserves")
    g.add_argument("--ray-num-gpus", type=float, default=0.0, help="ray: GPUs each replica actor reserves")
    g.add_argument("--replica-log-dir", default=None, help="local: write each replica's log here")
    _router_args(p, "--router-policy")


def _console_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("console (GET /ui: live view, playground, benchmark history)")
    g.add_argument("--bench-dir", default=None, metavar="DIR",
                   help="where tripod bench wrote its runs (a --out folder, or a folder of them): the "
                        "console's Benchmarks view and history")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripod", description="tripod: mission-critical LLM inference")
    parser.add_argument("--log-level", default=os.environ.get("TRIPOD_LOG_LEVEL", "INFO"))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="generate text offline (no server); no prompt = interactive chat")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt; omit for an interactive chat")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="system message for chat mode")
    gen.add_argument("--stats", action="store_true", help="print token counts and speed after each answer")
    gen.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    _engine_args(gen)
    _sampling_args(gen)

    srv = sub.add_parser("serve", help="serve the OpenAI API (default: the embedded SmolLM2 on 127.0.0.1:8000)")
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    _engine_args(srv)
    _server_args(srv)
    _fleet_args(srv)
    _console_args(srv)

    rte = sub.add_parser("route", help="route the OpenAI API over running servers (--replica URL ...)")
    rte.add_argument("--replica", action="append", default=[], metavar="URL", help="a server; repeat for each")
    rte.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    rte.add_argument("--port", type=int, default=8000)
    rte.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    rte.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    rte.add_argument("--api-key", default=os.environ.get("TRIPOD_API_KEY"),
                     help="require this key on the console's JSON API (/ui/api/*); the replicas check "
                          "their own on the API (default: $TRIPOD_API_KEY)")
    _router_args(rte, "--policy")
    _console_args(rte)

    chat = sub.add_parser("chat", help="chat in the terminal, with a server (--url) or an in-process engine")
    chat.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: in-process)")
    chat.add_argument("--api-key", default=os.environ.get("TRIPOD_API_KEY"), help="for --url (default: $TRIPOD_API_KEY)")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    _engine_args(chat)
    _sampling_args(chat)

    bench = sub.add_parser("bench", help="benchmark servers: throughput vs interactivity (see --help)",
                           description="Measure tripod and any OpenAI-compatible server side by side. "
                           "'tripod bench compare DIR...' overlays earlier runs.")
    bench.add_argument("action", nargs="?", default="run", choices=["run", "compare"])
    bench.add_argument("dirs", nargs="*", help="compare: result folders to overlay")
    bench.add_argument("--log-level", default=argparse.SUPPRESS, help="as the top-level --log-level")
    from tripod.bench.main import add_arguments

    add_arguments(bench)

    from tripod.chains.cli import add_parser as add_chains_parser

    add_chains_parser(sub)
    return parser


def _engine_config(args: argparse.Namespace) -> Any:
    from tripod.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        policy=args.policy,
        enable_prefix_cache=not args.no_prefix_cache,
        num_threads=args.threads,
        jump_forward=not args.no_jump_forward,
        kernels=args.kernels,
        weights=args.weights,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        spec_max_batch=args.spec_max_batch,
    )


def _make_engine(args: argparse.Namespace) -> Any:
    from tripod.engine.engine import Engine

    return Engine(config=_engine_config(args))


def _params(args: argparse.Namespace) -> Any:
    from tripod.engine.request import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _stream_answer(engine: Any, prompt: Any, params: Any, show_stats: bool) -> str:
    t0 = time.monotonic()
    first = None
    text: list[str] = []
    ntok = 0
    cached = 0
    reason = None
    for d in engine.stream(prompt, params):
        if first is None:
            first = time.monotonic()
        ntok += len(d.token_ids)
        cached = d.cached_tokens
        text.append(d.text)
        sys.stdout.write(d.text)
        sys.stdout.flush()
        reason = d.finish_reason or reason
    sys.stdout.write("\n")
    if show_stats:
        dt = time.monotonic() - t0
        ttft = (first or t0) - t0
        rate = (ntok - 1) / (dt - ttft) if ntok > 1 and dt > ttft else 0.0
        print(
            f"[{ntok} tokens, finish={reason}, cached prompt tokens={cached}, "
            f"TTFT {ttft * 1000:.0f} ms, {rate:.1f} tok/s]",
            file=sys.stderr,
        )
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _params(args)
    if args.prompt is not None:
        if args.raw:
            prompt: Any = args.prompt
        else:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            prompt = engine.apply_chat_template(msgs)
        _stream_answer(engine, prompt, params, args.stats)
        return 0
    return _chat_loop(_LocalChat(engine, params), args.system)


class _TooLong(Exception):
    """The conversation no longer fits the context."""


class _LocalChat:
    """Chat turns on an in-process engine."""

    def __init__(self, engine: Any, params: Any) -> None:
        self.engine = engine
        self.params = params
        self.label = f"{engine.model_name} ({engine.dtype_name}, in-process)"

    def answer(self, history: list[dict[str, str]]) -> str:
        prompt = self.engine.apply_chat_template(history)
        if len(prompt) + 1 >= self.engine.max_request_len:
            raise _TooLong()
        return _stream_answer(self.engine, prompt, self.params, True)


class _RemoteChat:
    """Chat turns against a running server's /v1/chat/completions, streamed."""

    def __init__(self, url: str, api_key: str | None, args: argparse.Namespace) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(10.0, read=None))
        try:
            models = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {self.url}: {e}") from None
        if models.status_code != 200:
            raise ValueError(f"{self.url}/v1/models answered {models.status_code}: {models.text[:200]}")
        card = models.json()["data"][0]
        self.model = card["id"]
        self.label = f"{self.model} ({card.get('dtype')}) at {self.url}"
        self.sampling = {
            "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
            "seed": args.seed, "ignore_eos": args.ignore_eos,
        }

    def answer(self, history: list[dict[str, str]]) -> str:
        import json

        body = {"model": self.model, "messages": history, "stream": True, **self.sampling}
        text: list[str] = []
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                err = json.loads(r.read() or b"{}").get("error", {})
                if err.get("code") == "context_length_exceeded":
                    raise _TooLong()
                raise ValueError(f"the server answered {r.status_code}: {err.get('message', r.text[:200])}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise ValueError(f"the server stopped the answer: {obj['error'].get('message')}")
                for ch in obj.get("choices", []):
                    piece = ch.get("delta", {}).get("content") or ""
                    text.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        sys.stdout.write("\n")
        return "".join(text)


def _chat_loop(backend: Any, system: str | None) -> int:
    """Interactive chat: the whole history is re-sent each turn; the prefix cache makes that cheap."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    first = len(history)
    print(f"tripod chat with {backend.label}; empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        answer = None
        while answer is None:
            try:
                answer = backend.answer(history)
            except _TooLong:
                # Drop the oldest turn (keeping a system message) while the history overflows.
                if len(history) - first > 1:
                    del history[first : first + 2]
                    continue
                print("tripod: this message alone is longer than the context; shorten it", file=sys.stderr)
                break
            except ValueError as e:
                print(f"tripod: {e}", file=sys.stderr)
                break
        if answer is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": answer})


def cmd_chat(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one log line per turn is noise here
    if args.url:
        return _chat_loop(_RemoteChat(args.url, args.api_key, args), args.system)
    return _chat_loop(_LocalChat(_make_engine(args), _params(args)), args.system)


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


def _router_config(args: argparse.Namespace) -> Any:
    from tripod.config import RouterConfig

    return RouterConfig(
        host=args.host, port=args.port, policy=args.router_policy, load_weight=args.load_weight,
        balance_abs=args.balance_abs, balance_rel=args.balance_rel, max_retries=args.max_retries,
        stall_timeout=args.stall_timeout,
        max_pending=args.max_pending, queue_timeout=args.queue_timeout, health_interval=args.health_interval,
        api_key=args.api_key or None, bench_dir=args.bench_dir,
    )


def _replica_args(args: argparse.Namespace, threads: int | None) -> list[str]:
    """The engine and server options of ``tripod serve``, rebuilt as each replica's command line
    (its own --host/--port aside), from the same definitions the parser uses: an option added to
    ``_engine_args`` or ``_server_args`` reaches the replicas with no list to keep in step."""
    spec = argparse.ArgumentParser(add_help=False)
    _engine_args(spec)
    _server_args(spec)
    out: list[str] = []
    # NOTE: argparse has no public list of a parser's options; ``_actions`` is the stable one.
    for action in spec._actions:
        if action.dest in ("host", "port", "threads"):
            continue
        value = getattr(args, action.dest, None)
        if action.nargs == 0:  # a flag (store_true)
            out += [action.option_strings[0]] if value else []
        elif value is not None and value != "":
            out += [action.option_strings[0], str(value)]
    out += ["--log-level", str(args.log_level)]
    if threads is not None:
        out += ["--threads", str(threads)]
    return out


def cmd_fleet(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tripod.config import FleetConfig
    from tripod.fleet.launch import serve_fleet

    # The replicas' engine options are checked once, here: a bad value (--num-draft-tokens 0) is
    # one clear exit 2 rather than every replica failing to start.
    _engine_config(args)
    lo = args.min_replicas if args.min_replicas is not None else (args.replicas or 1)
    hi = args.max_replicas if args.max_replicas is not None else (args.replicas or lo)
    fleet = FleetConfig(
        min_replicas=lo, max_replicas=hi, backend=args.backend, ray_address=args.ray_address,
        ray_num_cpus=args.ray_num_cpus, ray_num_gpus=args.ray_num_gpus, target_inflight=args.target_inflight,
        lookback=args.lookback, upscale_delay=args.upscale_delay, downscale_delay=args.downscale_delay,
        drain_timeout=args.drain_timeout,
    )
    threads = args.threads
    if threads is None and args.backend == "local" and args.device == "cpu":
        threads = max(1, (os.cpu_count() or 1) // hi)  # replicas share this machine's cores
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    log_dir = Path(args.replica_log_dir) if args.replica_log_dir else None
    return serve_fleet(_router_config(args), fleet, _replica_args(args, threads), level, log_dir)


def cmd_route(args: argparse.Namespace) -> int:
    from tripod.fleet.launch import route

    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    return route(_router_config(args), args.replica, level, args.drain_timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    from tripod.config import ServerConfig
    from tripod.server.launch import serve

    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None \
            or args.backend != "local":
        return cmd_fleet(args)

    cfg = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or None,
        served_model_name=args.served_model_name, max_waiting=args.max_waiting,
        overload_status=args.overload_status, drain_timeout=args.drain_timeout, max_n=args.max_n,
        bench_dir=args.bench_dir,
    )
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    return serve(_engine_config(args), cfg, level)


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
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
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
