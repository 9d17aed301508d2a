"""The ``tripod`` command line.

``tripod generate "prompt"`` streams one completion; with no prompt it opens an interactive
chat on stdin (multi-turn, the history reused through the prefix cache).
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
    return parser


def _make_engine(args: argparse.Namespace) -> Any:
    from tripod.config import EngineConfig
    from tripod.engine.engine import Engine

    cfg = EngineConfig(
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
    )
    return Engine(config=cfg)


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
    # Interactive chat: the whole history is re-sent each turn; the prefix cache makes that cheap.
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"tripod chat with {engine.model_name} ({engine.dtype_name}); empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        prompt = engine.apply_chat_template(history)
        # Drop the oldest turns (keeping a system message) while the history overflows the context.
        first = 1 if history[0]["role"] == "system" else 0
        while len(prompt) >= engine.max_request_len and len(history) - first > 1:
            del history[first : first + 2]
            prompt = engine.apply_chat_template(history)
        try:
            answer = _stream_answer(engine, prompt, params, True)
        except ValueError as e:  # still too long on its own: say so and keep the session
            print(f"tripod: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


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
    if args.command == "generate":
        try:
            return cmd_generate(args)
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
