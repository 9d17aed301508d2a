"""Benchmark traffic, generated locally from a seed (no downloads).

Each dataset yields ``BenchRequest``s: a prompt (text for /v1/completions) or messages (for
/v1/chat/completions), the output length to ask for, and for ``agentic`` the session it belongs
to. ``copy`` (rewrite / rename / reverse / repeat: answers that reuse the prompt; see
``copy_tasks.py``) asks for at most ``osl`` tokens and lets the model stop by itself. Lengths are in tokens of the target's tokenizer (``tokenizer``: anything with ``encode`` and
``decode``, e.g. the served model's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

DATASETS = ("random", "shared-prefix", "agentic", "structured", "copy")
TRACE = "trace"  # a recorded file replayed as recorded (bench/trace.py), not generated here

_WORDS = (
    "time river stone light cloud garden window market letter engine signal harbor forest lantern "
    "winter mirror bridge candle meadow orbit thunder copper valley ribbon glacier pepper socket "
    "violet anchor basket canyon desert falcon hammer island jacket kettle ladder magnet needle "
    "oyster pillow quartz rocket saddle tunnel umbrella vessel walnut yellow zipper planet silver "
    "north shadow branch circle dragon feather growth honest"
).split()


@dataclass(slots=True)
class BenchRequest:
    max_tokens: int
    prompt: str | None = None  # /v1/completions
    # /v1/completions with token ids (agentic --agentic-echo); with ``extends``, the runner sends
    # the previous turn's ids + the server's answer ids + these (bench/runner.py: extend_turn)
    prompt_ids: list[int] | None = None
    extends: bool = False
    messages: list[dict[str, Any]] | None = None  # /v1/chat/completions
    session: str | None = None
    turn: int = 0
    think_time: float = 0.0  # seconds to wait before sending (agentic turns)
    offset: float | None = None  # trace replay: when to send, seconds after the replay's start
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. response_format


class TextMaker:
    """Makes text of an exact token length in the target's tokenizer."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng

    def text(self, n_tokens: int, lead: str = "") -> str:
        words = [lead] if lead else []
        while True:
            words += [self.rng.choice(_WORDS) for _ in range(max(8, n_tokens))]
            ids = self.tok.encode(" ".join(words), add_special_tokens=False)
            if len(ids) >= n_tokens:
                break
        # NOTE: decode(ids[:n]) can re-tokenize to n ± 1 at the cut; the client records the
        # exact count from the server's usage.
        return str(self.tok.decode(ids[:n_tokens]))


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


@dataclass(frozen=True, slots=True)
class _Shape:
    """The options of ``make_requests`` that shape the traffic."""

    isl: int
    osl: int
    range_ratio: float
    seed: int
    prefix_len: int
    num_groups: int
    turns: int
    think_time: float


def make_requests(
    name: str,
    count: int,
    tokenizer: Any,
    *,
    isl: int = 256,
    osl: int = 128,
    range_ratio: float = 0.0,
    seed: int = 0,
    prefix_len: int = 1024,
    num_groups: int = 4,
    turns: int = 4,
    think_time: float = 0.0,
) -> list[BenchRequest]:
    """``count`` requests of dataset ``name`` (for ``agentic``: turns of ⌈count/turns⌉ sessions)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    rng = random.Random(seed)
    mk = TextMaker(tokenizer, rng)
    shape = _Shape(isl, osl, range_ratio, seed, prefix_len, num_groups, turns, think_time)
    if name == "copy":
        return _copy(count, tokenizer, rng, shape)
    make = {"random": _random, "shared-prefix": _shared_prefix, "structured": _structured}.get(name, _agentic)
    return make(count, mk, rng, shape)


def _random(count: int, mk: TextMaker, rng: random.Random, o: _Shape) -> list[BenchRequest]:
    # A distinct lead word per request: no two prompts share a cached prefix.
    return [BenchRequest(_length(rng, o.osl, o.range_ratio),
                         prompt=mk.text(_length(rng, o.isl, o.range_ratio), lead=f"Request {o.seed}-{i}:"))
            for i in range(count)]


def _shared_prefix(count: int, mk: TextMaker, rng: random.Random, o: _Shape) -> list[BenchRequest]:
    prefixes = [mk.text(o.prefix_len, lead=f"System {o.seed}-{g}:") for g in range(o.num_groups)]
    out = []
    for i in range(count):
        q = mk.text(_length(rng, o.isl, o.range_ratio), lead=f"Question {i}:")
        out.append(BenchRequest(_length(rng, o.osl, o.range_ratio), prompt=prefixes[i % o.num_groups] + "\n" + q))
    return out


def _copy(count: int, tokenizer: Any, rng: random.Random, o: _Shape) -> list[BenchRequest]:
    from tripod.bench.copy_tasks import copy_prompts

    # A distinct lead per request: no two prompts share a cached prefix beyond the chat header.
    return [BenchRequest(o.osl, messages=[{"role": "user", "content": f"Task {o.seed}-{i}. {text}"}],
                         extra={"ignore_eos": False})
            for i, text in enumerate(copy_prompts(count, tokenizer, o.isl, rng))]


def _structured(count: int, mk: TextMaker, rng: random.Random, o: _Shape) -> list[BenchRequest]:
    out = []
    for i in range(count):
        schema = _SCHEMAS[i % len(_SCHEMAS)]
        out.append(BenchRequest(
            o.osl, messages=[{"role": "user", "content": f"Request {i}: " + mk.text(max(8, o.isl - 16))
                              + " Answer as JSON."}],
            extra={"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i % len(_SCHEMAS)}",
                                                                              "schema": schema}}},
        ))
    return out


def _agentic(count: int, mk: TextMaker, rng: random.Random, o: _Shape) -> list[BenchRequest]:
    """Sessions whose context grows turn by turn; some branch from a parent."""
    out: list[BenchRequest] = []
    turns = o.turns
    sessions = max(1, -(-count // turns))
    histories: list[list[dict[str, str]]] = []
    for s in range(sessions):
        parent = histories[rng.randrange(len(histories))] if histories and rng.random() < 0.25 else None
        history = [dict(m) for m in parent[: 1 + 2 * rng.randint(0, turns - 1)]] if parent else [
            {"role": "system", "content": mk.text(o.prefix_len // 2, lead=f"Agent {o.seed}-{s}:")}]
        for t in range(turns):
            if len(out) >= count:
                break
            kind = "Tool output" if t % 2 else "User"
            history = [*history, {"role": "user", "content": f"{kind} {t}: "
                                  + mk.text(_length(rng, o.isl, o.range_ratio))}]
            max_tokens = _length(rng, o.osl, o.range_ratio)
            think = rng.expovariate(1 / o.think_time) if o.think_time > 0 and t else 0.0
            out.append(BenchRequest(max_tokens, messages=history, session=f"s{o.seed}-{s}", turn=t, think_time=think))
            history = [*history, {"role": "assistant", "content": mk.text(_length(rng, o.osl, o.range_ratio))}]
        histories.append(history)
    return out


_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
                                      "is_capital": {"type": "boolean"}},
     "required": ["city", "population_millions", "is_capital"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
]
