"""Engine behaviour on the real embedded model: prefix cache, memory pressure, seeds, n > 1,
finish reasons, streaming, logprob plumbing and input validation.

Tripod's own greedy run (fp32, prefix cache off, with ``logprobs=2`` for the top-2 margins) is the
reference here; parity with Hugging Face is in ``test_engine_parity.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tripod import SamplingParams

SYSTEM = (
    "You are Quill, the archive assistant of the Harbour Street Library. You answer questions "
    "about the library's collections, opening hours and services. The library opens at 9 am "
    "and closes at 7 pm on weekdays, and at 5 pm on Saturdays; it is closed on Sundays. "
    "Members may borrow up to twelve books for three weeks, renewable twice online. The rare "
    "maps room is on the third floor and needs an appointment made a day ahead. The café on the "
    "ground floor serves tea, coffee and soup. Keep answers short, friendly and factual, and "
    "say so when you do not know something rather than guessing."
)
QUESTIONS = [
    "When does the library close on Saturday?",
    "How many books can I borrow?",
    "Where is the rare maps room?",
]


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def nocache_engine(make_engine: Any) -> Iterator[Any]:
    """Same weights and settings, but every prompt is computed (prefix cache disabled)."""
    eng = make_engine(enable_prefix_cache=False)
    yield eng
    eng.assert_consistent()


# ------------------------------------------------------------------------------ prefix cache
@pytest.mark.slow
def test_prefix_cache_is_transparent_for_a_shared_system_prompt(
    engine: Any, nocache_engine: Any, chat: Any, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    prompts = [chat(q, system=SYSTEM) for q in QUESTIONS]
    shared = _common_prefix(prompts[0], prompts[1])
    assert shared >= 100, "the system prompt should be a long shared prefix"
    params = _greedy(24, ignore_eos=True, logprobs=2)

    computed = []
    for p in prompts:
        (o,) = nocache_engine.generate([p], params)
        assert o.cached_tokens == 0
        computed.append(greedy_from_tripod(o))

    engine.reset_prefix_cache()
    outs = [engine.generate([p], params)[0] for p in prompts]
    assert outs[0].cached_tokens == 0
    for i in (1, 2):
        # The hit is exactly the longest token prefix shared with what is already cached.
        want = max(_common_prefix(prompts[i], prompts[j]) for j in range(i))
        assert want >= shared
        assert outs[i].cached_tokens == want, (i, outs[i].cached_tokens, want)
    for i, (o, ref) in enumerate(zip(outs, computed, strict=True)):
        check_greedy(o.token_ids, ref, f"question {i} with its prefix cached")

    # The same prompt again: everything but the last prompt token comes from the cache.
    (again,) = engine.generate([prompts[2]], params)
    assert again.cached_tokens == len(prompts[2]) - 1
    check_greedy(again.token_ids, computed[2], "question 2 fully cached")

    # In one batch with the cache warm: every prompt hits, tokens unchanged.
    batch = engine.generate(prompts, params)
    for i, (o, ref) in enumerate(zip(batch, computed, strict=True)):
        assert o.cached_tokens == len(prompts[i]) - 1
        check_greedy(o.token_ids, ref, f"question {i} cached, in a batch")


@pytest.mark.slow
def test_multi_turn_reuses_the_first_turns_output(
    engine: Any, nocache_engine: Any, chat: Any, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    engine.reset_prefix_cache()
    turn1 = chat("Name a colour of the rainbow.", system=SYSTEM)
    (o1,) = engine.generate([turn1], _greedy(20))
    assert o1.cached_tokens == 0
    # The second turn continues the first *as generated* (token ids, not re-tokenized text).
    history = turn1 + o1.token_ids
    tail = engine.encode("\n<|im_start|>user\nAnd another one?<|im_end|>\n<|im_start|>assistant\n")
    turn2 = history + tail
    params = _greedy(20, ignore_eos=True, logprobs=2)
    (o2,) = engine.generate([turn2], params)
    # Everything the first turn computed is reused: its prompt and all its output but the last
    # token (whose K/V is never computed, since nothing was generated after it).
    assert len(history) - 1 <= o2.cached_tokens <= len(history), (o2.cached_tokens, len(history))
    (ref,) = nocache_engine.generate([turn2], params)
    check_greedy(o2.token_ids, greedy_from_tripod(ref), "turn 2 on a cached turn 1")


# ------------------------------------------------------------------------------ memory pressure
@pytest.mark.slow
def test_tiny_kv_budget_evicts_waits_and_every_request_finishes(
    engine: Any, make_engine: Any, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    shared = "Here is a list of facts about animals that live in the ocean, one per line.\n"
    prompts = [
        engine.encode((shared if i % 2 == 0 else "") + f"Fact number {i + 1}: the {animal}")
        for i, animal in enumerate(
            ["octopus", "blue whale", "sea turtle", "jellyfish", "dolphin", "seahorse",
             "great white shark", "starfish", "manta ray", "clownfish"]
        )
    ]
    max_tokens = 64
    params = _greedy(max_tokens, ignore_eos=True, logprobs=2)
    engine.reset_prefix_cache()
    refs = [greedy_from_tripod(o) for o in engine.generate(prompts, params)]

    budget = 300
    need = sum(len(p) + max_tokens for p in prompts)
    assert need > 2 * budget, "the requests together must not fit in the pool"
    tiny = make_engine(kv_cache_tokens=budget)
    reqs = [tiny.add_request(p, params)[0] for p in prompts]
    waited_while_running = False
    steps = 0
    while tiny.has_work:
        tiny.step()
        steps += 1
        assert steps < 5000, "the tiny engine made no progress"
        sched = tiny.scheduler
        assert tiny.pool.allocator.num_free >= 0
        if sched.waiting and sched.running:
            waited_while_running = True
    tiny.assert_consistent()
    print(
        f"{budget}-token budget: {steps} steps, {tiny.scheduler.num_retractions} retractions, "
        f"{tiny.cache.stats.evicted_tokens} tokens evicted"
    )
    assert waited_while_running, "some requests should have had to wait for KV memory"
    assert tiny.scheduler.num_retractions > 0, "the budget should have forced retractions"
    assert tiny.cache.stats.evicted_tokens > 0, "the budget should have forced cache evictions"
    for i, (r, ref) in enumerate(zip(reqs, refs, strict=True)):
        assert r.finish_reason is not None and r.finish_reason.value == "length", (i, r.finish_reason)
        assert r.error is None
        check_greedy(r.output_ids, ref, f"request {i} under a {budget}-token KV budget")
    # Idle: every slot is free or in the (unpinned) prefix cache.
    assert tiny.cache.protected_size == 0
    assert tiny.pool.allocator.num_free + tiny.cache.total_size == budget
    tiny.reset_prefix_cache()
    assert tiny.pool.allocator.num_free == budget


# ------------------------------------------------------------------------------ sampling
@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_seeded_sampling_is_identical_alone_and_in_a_mixed_batch(engine: Any, chat: Any) -> None:
    prompt = chat("Write a short poem about autumn leaves.")
    seeded = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([prompt], seeded)
    (again,) = engine.generate([prompt], seeded)
    assert again.token_ids == alone.token_ids, "same seed, same prompt, different tokens"
    assert len(alone.token_ids) == 32

    engine.reset_prefix_cache()
    mixed = engine.generate(
        [
            chat("Explain photosynthesis to a child.", system=SYSTEM),
            prompt,
            "Once upon a time in a small village",
            chat("List three fruits."),
            prompt,
            "The weather today is",
        ],
        [
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
            seeded,
            SamplingParams(max_tokens=20, temperature=1.0, top_k=50, seed=7),
            SamplingParams(max_tokens=12, temperature=0.7, min_p=0.05),  # unseeded
            seeded,  # the same request twice in one batch (the second hits the first's prefix)
            SamplingParams(max_tokens=5, temperature=0.0),
        ],
    )
    assert mixed[1].token_ids == alone.token_ids, "a seeded request changed inside a mixed batch"
    assert mixed[4].token_ids == alone.token_ids, "a seeded duplicate changed inside a mixed batch"
    # The seed matters: another seed gives another sample.
    (other,) = engine.generate([prompt], SamplingParams(**{**_fields(seeded), "seed": 4321}))
    assert other.token_ids != alone.token_ids


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {name: getattr(p, name) for name in p.__dataclass_fields__}


@pytest.mark.slow
def test_n_copies_share_the_prompt(engine: Any, chat: Any) -> None:
    prompt = chat("Invent a name for a friendly robot.")
    engine.reset_prefix_cache()
    outs = engine.generate([prompt], SamplingParams(n=3, max_tokens=16, temperature=0.9, seed=99))
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({o.request_id for o in outs}) == 3
    assert outs[0].cached_tokens == 0
    for o in outs[1:]:
        assert o.cached_tokens == len(prompt) - 1, "later copies should reuse the first's prompt"
    texts = [tuple(o.token_ids) for o in outs]
    assert len(set(texts)) == 3, f"seeded copies should differ from each other: {texts}"
    # Reproducible as a group.
    again = engine.generate([prompt], SamplingParams(n=3, max_tokens=16, temperature=0.9, seed=99))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]

    # Greedy copies are all the greedy answer.
    (single,) = engine.generate([prompt], _greedy(16))
    copies = engine.generate([prompt], _greedy(16, n=2))
    assert [c.token_ids for c in copies] == [single.token_ids] * 2


# ------------------------------------------------------------------------------ finishing
def test_finish_reasons(engine: Any) -> None:
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is": greedy ends in EOS
    eos = set(engine.eos_ids)
    (free,) = engine.generate([prompt], _greedy(64))
    assert free.finish_reason == "stop"
    assert free.token_ids[-1] in eos and len(free.token_ids) < 64
    n_eos = len(free.token_ids)

    # ignore_eos: runs through the EOS to max_tokens, same tokens up to it.
    (through,) = engine.generate([prompt], _greedy(n_eos + 8, ignore_eos=True))
    assert through.finish_reason == "length" and len(through.token_ids) == n_eos + 8
    assert through.token_ids[:n_eos] == free.token_ids

    # max_tokens.
    (short,) = engine.generate([prompt], _greedy(5))
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:5]

    # stop_token_ids: stop at the first occurrence of a token seen mid-answer.
    k = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i])
    stop = free.token_ids[k]
    (stopped,) = engine.generate([prompt], _greedy(64, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids in (free.token_ids[:k], free.token_ids[: k + 1]), (stopped.token_ids, k)
    # A stop token wins over ignore_eos.
    (stopped2,) = engine.generate([prompt], _greedy(64, stop_token_ids=[stop], ignore_eos=True))
    assert stopped2.finish_reason == "stop" and stopped2.token_ids == stopped.token_ids


def test_generation_stops_at_the_context_limit(make_engine: Any) -> None:
    eng = make_engine(max_model_len=64, kv_cache_tokens=512)
    prompt = eng.encode("Count with me: one, two, three, four, five, six, seven,")
    (o,) = eng.generate([prompt], _greedy(500, ignore_eos=True))
    assert o.finish_reason == "length"
    assert len(prompt) + len(o.token_ids) == 64
    # The longest allowed prompt still gets one token.
    (o,) = eng.generate([list(range(100, 163))], _greedy(10, ignore_eos=True))
    assert len(o.token_ids) == 1 and o.finish_reason == "length"
    eng.assert_consistent()


# ------------------------------------------------------------------------------ streaming
@pytest.mark.parametrize(
    "prompt_text",
    [
        "用中文写一句关于春天的话。",
        "Translate 'good morning, my friend' into Chinese.",
        "Reply with three emojis that describe happiness.",
        "Tell me a fun fact about the moon.",
    ],
)
@pytest.mark.slow
def test_stream_text_equals_generate_text(engine: Any, chat: Any, prompt_text: str) -> None:
    prompt = chat(prompt_text)
    params = _greedy(40)
    (full,) = engine.generate([prompt], params)
    deltas = list(engine.stream(prompt, params))
    assert deltas, "stream yielded nothing"
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == full.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].cached_tokens == len(prompt) - 1  # generate() cached the prompt


def test_stream_and_generate_produce_non_ascii(engine: Any, chat: Any) -> None:
    """The streaming test above is only meaningful if some outputs are non-ASCII."""
    texts = [
        engine.generate([chat(q)], _greedy(40))[0].text
        for q in ("用中文写一句关于春天的话。", "Reply with three emojis that describe happiness.")
    ]
    joined = "".join(texts)
    assert any(ord(c) > 0x2E80 for c in joined), texts  # CJK or emoji


def test_stream_closed_early_aborts_and_frees_kv(engine: Any, chat: Any) -> None:
    engine.reset_prefix_cache()
    total = engine.pool.allocator.num_slots
    it = engine.stream(chat("Write a long story about a lighthouse keeper."), _greedy(200))
    got = [next(it) for _ in range(3)]
    assert all(d.finish_reason is None for d in got)
    assert engine.scheduler.running, "the request should be running mid-stream"
    it.close()
    assert not engine.has_work, "closing the stream should abort the request"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.assert_consistent()
    assert engine.cache.protected_size == 0
    assert engine.pool.allocator.num_free + engine.cache.total_size == total
    engine.reset_prefix_cache()
    assert engine.pool.allocator.num_free == total, "KV slots leaked by the aborted stream"
    # The engine still serves afterwards.
    (o,) = engine.generate(["Hello"], _greedy(3))
    assert len(o.token_ids) == 3


# ------------------------------------------------------------------------------ validation
def test_bad_inputs_raise_helpful_errors(engine: Any, make_engine: Any) -> None:
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", _greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], _greedy(4))
    with pytest.raises(ValueError, match=str(vocab)):
        engine.generate([[1, 2, vocab]], _greedy(4))
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[1, -5, 3]], _greedy(4))
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate(["a", "b"], [_greedy(4)])
    with pytest.raises(ValueError, match="empty"):
        list(engine.stream("", _greedy(4)))
    assert not engine.has_work

    small = make_engine(max_model_len=64, kv_cache_tokens=512)
    with pytest.raises(ValueError, match=r"context.*shorten"):
        small.generate([list(range(100, 164))], _greedy(4))
    with pytest.raises(ValueError, match="64 tokens"):
        small.generate([list(range(100, 164))], _greedy(4))
    assert not small.has_work
    small.assert_consistent()


def test_a_bad_prompt_in_a_batch_queues_nothing(engine: Any) -> None:
    """``generate`` either answers the whole batch or raises; a rejected batch must not leave
    its valid prompts queued (they would run later, unasked, and nobody would get them)."""
    try:
        with pytest.raises(ValueError, match="empty"):
            engine.generate(["A perfectly fine prompt", ""], _greedy(4))
        assert not engine.has_work, (
            f"a rejected batch left {len(engine.scheduler.waiting)} request(s) queued"
        )
    finally:
        # Keep the shared engine usable for the tests after this one, whatever happened.
        for r in list(engine.scheduler.waiting) + list(engine.scheduler.running):
            engine.scheduler.abort(r)
        engine.step()


def test_interleaved_streams_each_get_every_token(engine: Any, chat: Any) -> None:
    # Two streams consumed in turn: each step one of them runs also produces the other's
    # tokens, which must still reach the other stream.
    prompts = [chat("Name three rivers."), chat("Count from one to five.")]
    params = _greedy(16, ignore_eos=True)
    want = engine.generate(prompts, params)
    streams = [engine.stream(p, params) for p in prompts]
    got: list[list[int]] = [[], []]
    texts = ["", ""]
    live = [True, True]
    while any(live):
        for i, s in enumerate(streams):
            if not live[i]:
                continue
            try:
                d = next(s)
            except StopIteration:
                live[i] = False
                continue
            got[i].extend(d.token_ids)
            texts[i] += d.text
    for i in range(2):
        assert got[i] == want[i].token_ids
        assert texts[i] == want[i].text


def test_aborting_a_streamed_request_ends_its_stream(engine: Any) -> None:
    stream = engine.stream("Hello there, how are", _greedy(40, ignore_eos=True))
    first = next(stream)
    assert engine.abort(first.request_id)
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort"


def test_abort_takes_only_the_named_request_and_its_copies(engine: Any) -> None:
    a = engine.add_request("One two three", _greedy(4), request_id="chat")[0]
    b = engine.add_request("Four five six", _greedy(4), request_id="chat-2")[0]
    assert engine.abort("chat")
    while engine.has_work:
        engine.step()
    engine.step()  # report the aborted one
    assert a.finish_reason == "abort" and b.finish_reason == "length"


@pytest.mark.slow
def test_decode_mirror_memory_stays_within_budget_and_is_freed_when_idle(make_engine: Any) -> None:
    eng = make_engine(kv_cache_tokens=2048, max_model_len=2048)
    mirror = eng.runner.mirror
    # Room for 32 short rows, not for a 1,300-token row: the short batch uses the mirror and the
    # long request must not grow it past the budget (it falls back to gathering instead).
    mirror.max_bytes = 32 * 256 * mirror._row_token_bytes
    peak = 0
    for prompts in (["Hi"] * 32, ["word " * 1300]):
        for r in [q for p in prompts for q in eng.add_request(p, _greedy(3, ignore_eos=True))]:
            assert r is not None
        while eng.has_work:
            eng.step()
            if mirror.buf is not None:
                peak = max(peak, mirror.buf.numel() * mirror.buf.element_size())
    assert 0 < peak <= mirror.max_bytes
    assert mirror.buf is None, "an idle engine keeps the decode mirror allocated"
    eng.assert_consistent()
