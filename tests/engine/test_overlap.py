"""The overlap scheduler (engine/overlap.py) changes no output: on the embedded model, on tripod's
CPU kernels (the slot-table layout the Triton backend shares), a workload of arrivals, aborts,
stop tokens, length limits, seeded sampling, penalties and logprobs gives the same tokens,
logprobs and finish reasons with ``--overlap-schedule on`` as with ``off``; the prepared steps
are adopted on quiet decodes and given back (their slots freed) on every change; a prepared
step's layout is the one the runner builds for the scheduler's own decision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from tripod import SamplingParams
from tripod.engine import builder
from tripod.engine.overlap import Lookahead

SEEDED = dict(temperature=0.8, top_p=0.9, seed=7)


def _drive(eng: Any, script: dict[int, list[tuple[str, Any, SamplingParams]]], aborts: dict[int, str]) -> dict[str, Any]:
    """Step ``eng`` to idle, adding ``script[k]``'s requests and aborting ``aborts[k]`` before step
    k; the engine's KV bookkeeping is checked after every step. Returns each request's result."""
    got: dict[str, Any] = {}
    k = 0
    while k <= max(script) or eng.has_work:
        for rid, prompt, params in script.get(k, []):
            eng.add_request(prompt, params, request_id=rid)
            got[rid] = ([], [], None)
        if k in aborts:
            eng.abort(aborts[k])
        for out in eng.step():
            toks, lps, _ = got[out.req.rid]
            toks += out.new_token_ids
            lps += [(lp.token_id, round(lp.logprob, 6)) for lp in out.new_logprobs]
            if out.finished:
                got[out.req.rid] = (toks, lps, out.req.finish_reason)
        eng.assert_consistent()
        k += 1
    return got


def _workload(chat: Callable[..., list[int]]) -> tuple[dict[int, list[Any]], dict[int, str]]:
    qs = ["Name three rivers.", "What is 2 + 2?", "Write a haiku about tea.", "Say hello.", "List colours."]
    p = [chat(q) for q in qs]
    script = {
        0: [("greedy", p[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)),
            ("seeded", p[1], SamplingParams(max_tokens=20, ignore_eos=True, **SEEDED)),
            ("stops", p[2], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[28, 30, 198, 355]))],
        5: [("late", p[3], SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.5))],
        9: [("aborted", p[4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))],
        14: [("penalised", p[0], SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.0,
                                                 ignore_eos=True, logprobs=1))],
    }
    return script, {20: "aborted"}


@pytest.fixture(scope="module")
def pair(make_engine: Any) -> tuple[Any, Any]:
    on = make_engine(kernels="optimized", overlap_schedule="on", max_running=8)
    off = make_engine(kernels="optimized", overlap_schedule="off", max_running=8)
    assert on.lookahead is not None and off.lookahead is None
    return on, off


def test_outputs_are_the_same_with_the_overlap_scheduler(pair: tuple[Any, Any], chat: Any) -> None:
    on, off = pair
    script, aborts = _workload(chat)
    ref = _drive(off, script, aborts)
    counts = on.lookahead.counts
    adopted, discarded = counts.adopted, counts.discarded
    got = _drive(on, script, aborts)
    assert got == ref
    assert ref["aborted"][2] is not None and ref["stops"][2].value == "stop", ref
    assert counts.adopted - adopted >= 10, counts  # quiet decode steps ran as laid out ahead
    assert counts.discarded - discarded >= 2, counts  # arrivals, the abort, the stop
    assert on.lookahead.prepared is None or on.has_work
    assert on.pool.allocator.free_on(0) == off.pool.allocator.free_on(0)  # no reserved slot left behind


def test_a_prepared_step_is_the_layout_of_the_schedulers_own_step(pair: tuple[Any, Any], chat: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    on, _ = pair
    seen: list[int] = []
    take = Lookahead.take

    def checked(self: Lookahead) -> Any:
        p = take(self)
        if p is not None:
            fresh, rows = self.runner.build_batch(p.items)  # what the step would have been built as
            assert [id(it.req) for it in rows] == [id(it.req) for it in p.sampling]
            for name in ("input_ids", "positions", "out_slots"):
                assert torch.equal(getattr(p.batch, name), getattr(fresh, name)), name
            assert p.batch.input_ids.tolist() == [it.req.output_ids[-1] for it in p.items]
            assert torch.equal(p.batch.kernel.rows, fresh.kernel.rows) and torch.equal(p.batch.kernel.lens, fresh.kernel.lens)
            seen.append(len(p.items))
        return p

    monkeypatch.setattr(Lookahead, "take", checked)
    prompts = [chat(q) for q in ("One.", "Two, three.", "Four, five, six.")]
    outs = on.generate(prompts, [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
                                 for i in range(3)])
    assert [len(o.token_ids) for o in outs] == [6, 9, 12]
    assert seen and max(seen) == 3, seen


@pytest.mark.slow
def test_memory_pressure_retracts_the_same_way(make_engine: Any, chat: Any) -> None:
    """A pool too small for everyone: no step is laid out ahead when the scheduler might evict or
    retract, and the retractions (and so the outputs) are those of the plain scheduler."""
    prompts = [chat(q) for q in ("Tell me about owls.", "Tell me about bats.", "Tell me about moles.")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    res = {}
    for mode in ("off", "on"):
        eng = make_engine(kernels="optimized", overlap_schedule=mode, kv_cache_tokens=160, enable_prefix_cache=False)
        outs = eng.generate(prompts, params)
        res[mode] = ([o.token_ids for o in outs], eng.scheduler.num_retractions)
        eng.assert_consistent()
    assert res["on"] == res["off"]
    assert res["off"][1] > 0, "the pool was meant to be too small"


def test_where_the_overlap_scheduler_runs(make_engine: Any) -> None:
    auto = make_engine(kernels="optimized")
    assert auto.config.overlap_schedule == "auto" and auto.lookahead is None  # a CPU's forward is synchronous

    class Runner:
        def __init__(self, *, triton: bool, cuda: bool, group: object | None = None) -> None:
            self.triton, self.group = triton, group
            self.device = torch.device("cuda" if cuda else "cpu")

    cfg = auto.config
    assert builder.overlaps(cfg, Runner(triton=True, cuda=True))  # type: ignore[arg-type]
    assert not builder.overlaps(cfg, Runner(triton=False, cuda=True))  # type: ignore[arg-type]
    assert not builder.overlaps(replace(cfg, overlap_schedule="on"), Runner(triton=True, cuda=True, group=object()))  # type: ignore[arg-type]
    assert not builder.overlaps(replace(cfg, overlap_schedule="off"), Runner(triton=True, cuda=True))  # type: ignore[arg-type]
    assert builder.overlaps(replace(cfg, overlap_schedule="on"), Runner(triton=False, cuda=False))  # type: ignore[arg-type]
