"""Turns a batch of logits into next tokens, one row per request.

Logit bias first (OpenAI's ``logit_bias``: added to the raw logits), then penalties; whatever
the caller masked (grammars) stays masked. Greedy rows take the argmax. Sampled rows go through
temperature, top-k, top-p and min-p in one vectorised pass, then draw with the exponential race
(argmax p / E, E ~ Exp(1)).

Seeded requests draw *counter-based* noise: the noise of output position k (k = tokens the
sequence has generated before this one, prior output of a continuation included) is a pure
function of (seed, copy index, k, vocabulary index), a hash evaluated for the whole row at once
(``seeded_noise``). It never depends on how many draws came before, so a seeded request draws the
same tokens whatever else shares its batch, after a retraction, under speculative decoding (a
draft evaluates the noise of the positions it guesses), and when another replica continues it
from position k (the router's failover). Unseeded requests share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tripod.engine.request import Req, TokenLogprob
from tripod.layers.topk import topk_by_position


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(slots=True)
class Drawn:
    """A step's draws still on the logits' device: ``tokens`` ``[rows]`` and the adjusted logits
    their logprobs come from. ``Sampler.resolve`` brings them to the host (the step's one sync),
    so work that does not need the tokens' values can run while the device computes."""

    tokens: torch.Tensor
    logits: torch.Tensor
    reqs: list[Req]


class Sampler:
    """Stateless apart from the fallback generator used by unseeded sampled requests."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        reqs: list[Req],
        masks: torch.Tensor | None = None,
    ) -> SampleResult:
        """``logits`` float32 ``[len(reqs), V]``; ``masks`` optional bool ``[len(reqs), V]``
        (True = allowed) from the structured-outputs layer."""
        return self.resolve(self.sample_on_device(logits, reqs, masks))

    def sample_on_device(self, logits: torch.Tensor, reqs: list[Req], masks: torch.Tensor | None = None) -> Drawn:
        """``sample`` without the device→host copy: the tokens stay where the logits are."""
        assert logits.shape[0] == len(reqs)
        logits = self.adjust(logits, reqs)
        if masks is not None:
            logits = logits.masked_fill(~masks, float("-inf"))

        tokens = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(greedy) == len(reqs):
            tokens = logits.argmax(dim=-1)  # all greedy: no row gathers
        elif greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        if sampled:
            sub = [reqs[i] for i in sampled]
            tokens[sampled] = self.race(self.probs(logits[sampled], sub), sub)
        return Drawn(tokens, logits, reqs)

    def resolve(self, drawn: Drawn) -> SampleResult:
        out = drawn.tokens.tolist()
        return SampleResult(out, self.logprobs(drawn.logits, drawn.reqs, out))

    def adjust(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Logit bias, then penalties (a copy when any applies; masks already in stay)."""
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased or any(r.params.needs_penalties for r in reqs):
            logits = logits.clone()
            for i in biased:
                _apply_bias(logits[i], reqs[i])
            for i, r in enumerate(reqs):
                if r.params.needs_penalties:
                    _apply_penalties(logits[i], r)
        return logits

    def logprobs(self, logits: torch.Tensor, reqs: list[Req], tokens: list[int]) -> list[TokenLogprob | None]:
        """The chosen tokens' logprobs (and top-k) for the rows whose request asked, from the
        adjusted logits (before temperature, as OpenAI reports them)."""
        want_lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if not want_lp:
            return lps
        logprob_rows = torch.log_softmax(logits[want_lp], dim=-1)
        for j, i in enumerate(want_lp):
            row = logprob_rows[j]
            k = reqs[i].params.logprobs or 0
            top: list[tuple[int, float]] = []
            if k:
                vals, ids = topk_by_position(row, k)
                top = list(zip(ids.tolist(), vals.tolist(), strict=True))
            lps[i] = TokenLogprob(tokens[i], float(row[tokens[i]]), top)
        return lps

    def probs(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """The distribution sampled requests draw from: temperature, then top-k, top-p and
        min-p. Rows are not renormalised after filtering (the race does not need it)."""
        dev = logits.device
        _n, vocab = logits.shape
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev).unsqueeze(1)
        logits = logits / temp
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in reqs]
        if min(top_k) < vocab:
            kmax = max(k for k in top_k if k < vocab)
            # Exactly k tokens stay, the lowest ids winning ties at the k-th logit (by position).
            ids = topk_by_position(logits, kmax)[1]  # [n, kmax], best first
            ks = torch.tensor(top_k, device=dev).unsqueeze(1)
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, torch.arange(kmax, device=dev) < ks)
            logits = logits.masked_fill(~(keep | (ks >= vocab)), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p = [r.params.top_p for r in reqs]
        if min(top_p) < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # ties by position
            cum = sorted_p.cumsum(dim=-1)
            tp = torch.tensor(top_p, device=dev).unsqueeze(1)
            # Keep the smallest head whose mass reaches top_p (the first token always stays, even
            # for a top_p that rounds to 0 in float32).
            drop_sorted = (cum - sorted_p) >= tp
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_p = [r.params.min_p for r in reqs]
        if max(min_p) > 0.0:
            mp = torch.tensor(min_p, device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def race(self, probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Draw one index per row with probability proportional to ``probs``."""
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples index i with probability
        # p_i / sum(p), so no renormalisation is needed after filtering.
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.noise_key is None]
        seeded = [i for i, r in enumerate(reqs) if r.noise_key is not None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_(generator=self.generator)
        if seeded:
            keys = [position_key(reqs[i].noise_key, len(reqs[i].output_ids)) for i in seeded]
            rows = seeded_noise(keys, probs.shape[1], probs.device)
            if len(seeded) == len(reqs):
                noise = rows
            else:
                noise[seeded] = rows
        # NOTE: an Exp(1) draw can be exactly 0 in float32; 0 / 0 would be NaN, which argmax picks.
        return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def uniform(self) -> float:
        """One U(0, 1) draw from the engine's generator (speculative rejection sampling)."""
        return float(torch.rand((), generator=self.generator, device=self.device))

    def draw(self, weights: torch.Tensor) -> int:
        """One index drawn with probability proportional to ``weights`` (1-D), from the
        engine's generator."""
        noise = torch.empty_like(weights).exponential_(generator=self.generator)
        return int((weights / noise).argmax())


def _apply_bias(row: torch.Tensor, req: Req) -> None:
    bias = req.params.logit_bias
    assert bias
    ids = torch.tensor(list(bias.keys()), device=row.device)
    vals = torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device)
    # NOTE: a masked (-inf) logit stays -inf whatever its bias: a grammar is never broken.
    row.index_add_(0, ids, vals)


def _apply_penalties(row: torch.Tensor, req: Req) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_ids) | set(req.output_ids)), device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if req.output_ids and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
        ids = torch.tensor(req.output_ids, device=row.device)
        counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


# ---------------------------------------------------------------------- counter-based noise
_M64 = 0xFFFF_FFFF_FFFF_FFFF
_M32 = 0xFFFF_FFFF
_VOCAB_INDEX: dict[tuple[int, str], torch.Tensor] = {}


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with full avalanche."""
    x = (x + 0x9E37_79B9_7F4A_7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, copy: int = 0) -> int:
    """The key of one seeded sequence's noise: its request's seed and which of the ``n`` copies
    it is (copies of one request draw independently). Any integer seed is accepted (folded to
    64 bits)."""
    return _mix64(_mix64(seed & _M64) ^ (copy & _M64))


def position_key(key: int, position: int) -> int:
    """The key of the draw at output ``position`` (0 = the first generated token)."""
    return _mix64(key ^ _mix64(0x5851_F42D_4C95_7F2D ^ position))


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for int64 lanes holding 32-bit values, in two 16-bit halves of ``c``
    so that no product leaves int64's positive range (no reliance on overflow wrapping)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser (a bijection) on int64 lanes holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def seeded_uniform(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(keys), vocab]`` float64 uniforms in (0, 1), one row per position key: for a given
    key, vocabulary index v ↦ a keyed bijection of 32-bit integers (multiply, add key, fmix32,
    xor key, fmix32), so the row depends on nothing but the key."""
    at = (vocab, str(device))
    v = _VOCAB_INDEX.get(at)
    if v is None:
        v = _VOCAB_INDEX[at] = torch.arange(vocab, dtype=torch.int64, device=device).unsqueeze(0)
    lo = torch.tensor([x & _M32 for x in keys], dtype=torch.int64, device=device).unsqueeze(1)
    hi = torch.tensor([x >> 32 for x in keys], dtype=torch.int64, device=device).unsqueeze(1)
    h = _fmix32((_mul32(v, 0x9E37_79B1) + lo) & _M32)
    h = _fmix32(h ^ hi)
    return (h.to(torch.float64) + 0.5) * (1.0 / 2**32)


def seeded_noise(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(keys), vocab]`` float32 Exp(1) noise for the exponential race, one row per
    position key (``position_key``)."""
    return (-torch.log(seeded_uniform(keys, vocab, device))).to(torch.float32)
