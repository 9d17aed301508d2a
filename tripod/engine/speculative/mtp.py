"""DeepSeek-V3's multi-token-prediction module as a proposer (``--speculative mtp``).

The module at position i reads the target's last hidden state h[i] (before the final norm) and
the token t[i+1], and predicts t[i+2] (``models/deepseek.py`` ``MTPModule``). Its one decoder
layer has K/V of its own: a one-layer latent pool at the target's slot ids, so position i's MTP
latent lives in the slot of token i (the one allocator and the radix cache account for both).

- After every forward the engine hands over the target's hidden states (``observe_hidden``);
  they wait, per request and position, until the MTP has consumed them (a step later: position i
  needs t[i+1], and proposals are made before the step's forward).
- To propose for a request of ``L`` tokens the MTP runs positions it has not yet run, up to
  ``L - 2`` (inputs ``t[i+1]`` and ``h[i]``), as one causal chunk over its pool: the last row's
  logits give the first draft token. Further draft tokens chain: the module's own output hidden
  state stands in for the target's next one (not yet computed), one decode row per step.
- Per slot a stamp (token t[i+1], position i) says whose MTP latent it holds, so a prefix from the
  radix cache is reused when it was computed for the same next token. Chained rows are unstamped
  (computed from a stand-in hidden state), and positions whose hidden state the target never
  produced (a prefix served from the cache) keep whatever latent their slot has: both can only
  cost acceptance, never correctness — the target checks every draft token.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tripod.engine.sampler import Sampler
from tripod.engine.scheduler import ScheduledItem
from tripod.engine.speculative.draft_model import chain_drafts
from tripod.engine.speculative.proposer import Proposal, Proposer
from tripod.layers.backends import REFERENCE
from tripod.layers.batch import ForwardBatch, PrefillSegment

if TYPE_CHECKING:
    from tripod.engine.request import Req
    from tripod.memory.kv_pool import LatentPool
    from tripod.models.deepseek import DeepseekForCausalLM


class MTPProposer(Proposer):
    name = "mtp"
    writes_kv = True
    reads_hidden = True

    def __init__(self, target: DeepseekForCausalLM, pool: LatentPool, sampler: Sampler, *, catch_up: int) -> None:
        assert target.mtp is not None
        self.target, self.mtp, self.pool, self.sampler = target, target.mtp, pool, sampler
        self.catch_up = catch_up
        self.device = target.device
        n = pool.num_slots
        self._tok = np.full(n, -1, dtype=np.int64)  # per slot: the next token its MTP latent is for
        self._pos = np.full(n, -1, dtype=np.int64)  # ... and its position
        self._hidden: dict[int, tuple[Req, dict[int, torch.Tensor]]] = {}  # id(req) -> (req, pos -> h)
        target.capture_hidden = True

    # ------------------------------------------------------------------ hidden states
    def observe_hidden(self, item_rows: list[tuple[ScheduledItem, int]], hidden: torch.Tensor) -> None:
        for it, row in item_rows:
            r = it.req
            if not r.params.speculative:
                continue
            _, rows = self._hidden.setdefault(id(r), (r, {}))
            block = hidden[row : row + it.length].detach().clone()
            for j in range(it.length):
                rows[it.start + j] = block[j]
        for key in [k for k, (r, _) in self._hidden.items() if r.finished]:
            del self._hidden[key]

    # ------------------------------------------------------------------ MTP latents
    def _done(self, req: Req, upto: int) -> int:
        """How many of positions ``0 .. upto - 1`` hold this request's MTP latent."""
        n = min(upto, len(req.slots), len(req.all_ids) - 1)
        if n <= 0:
            return 0
        slots = np.fromiter(req.slots[:n], dtype=np.int64, count=n)
        nxt = np.fromiter(req.all_ids[1 : n + 1], dtype=np.int64, count=n)
        ok = (self._tok[slots] == nxt) & (self._pos[slots] == np.arange(n))
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else n

    def _segment(self, req: Req) -> tuple[int, int] | None:
        """The positions ``[start, end)`` the MTP can run now for ``req`` (end = L - 1)."""
        end = req.seq_len - 1
        rows = self._hidden.get(id(req), (req, {}))[1]
        start = self._done(req, end)
        while start < end and start not in rows:  # never produced by the target (cached prefix)
            start += 1
        for p in range(start, end):
            if p not in rows:  # a gap: run from after it
                start = p + 1
        if start >= end:
            return None
        return start, min(end, start + self.catch_up)

    def _run_chunks(self, segs: list[tuple[Req, int, int]], want: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Run the MTP over ``(req, start, end)`` position ranges as causal chunks; returns, for
        the requests in ``want``, the last row's (logits, own hidden state)."""
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        hid: list[torch.Tensor] = []
        prefills: list[PrefillSegment] = []
        last: list[int] = []
        for r, s, e in segs:
            n = e - s
            first = len(ids)
            rows = self._hidden[id(r)][1]
            ids.extend(r.all_ids[s + 1 : e + 1])
            pos.extend(range(s, e))
            slots.extend(r.slots[s:e])
            hid.extend(rows[p] for p in range(s, e))
            if s == 0:
                prefills.append(PrefillSegment(first, n, 0, None, None))
            else:
                kv = torch.tensor(r.slots[:e], dtype=torch.long, device=dev)
                q_pos = torch.arange(s, e, device=dev).unsqueeze(1)
                prefills.append(PrefillSegment(first, n, s, kv, torch.arange(e, device=dev).unsqueeze(0) <= q_pos))
            last.append(len(ids) - 1)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            out_slots=torch.tensor(slots, dtype=torch.long, device=dev),
            # (the module computes on the reference backend, whatever the target's steps run)
            num_decode=0, decode_kv_idx=None, decode_mask=None, backend=REFERENCE, prefills=prefills,
            logits_idx=torch.tensor(last, dtype=torch.long, device=dev),
        )
        logits, own = self.mtp(self.target, batch, torch.stack(hid), self.pool)
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for j, (r, s, e) in enumerate(segs):
            sl = np.asarray(r.slots[s:e], dtype=np.int64)
            self._tok[sl] = r.all_ids[s + 1 : e + 1]
            self._pos[sl] = np.arange(s, e)
            rows = self._hidden[id(r)][1]
            for p in range(s, e):  # consumed
                rows.pop(p, None)
            if id(r) in want:
                out[id(r)] = (logits[j], own[last[j]])
        return out

    def _chain(self, reqs: list[Req], toks: list[int], hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained draft step: each request's last draft token at its position, with the
        module's previous output standing in for the target's hidden state."""
        dev = self.device
        # The last draft token was appended to output_ids: it is t[i+1] for MTP position
        # i = L - 2 (L counting it), whose slot is reserved (the target's own for that token).
        pos = [r.seq_len - 2 for r in reqs]
        width = max(pos) + 1
        kv = [r.slots[: p + 1] + [0] * (width - p - 1) for r, p in zip(reqs, pos, strict=True)]
        lens = torch.tensor([p + 1 for p in pos], device=dev).unsqueeze(1)
        batch = ForwardBatch(
            input_ids=torch.tensor(toks, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            out_slots=torch.tensor([r.slots[p] for r, p in zip(reqs, pos, strict=True)], dtype=torch.long, device=dev),
            num_decode=len(reqs),
            decode_kv_idx=torch.tensor(kv, dtype=torch.long, device=dev),
            decode_mask=(torch.arange(width, device=dev).unsqueeze(0) < lens)[:, None, None, :],
            backend=REFERENCE,
        )
        self._tok[[r.slots[p] for r, p in zip(reqs, pos, strict=True)]] = -1  # stand-in hidden: unstamped
        return self.mtp(self.target, batch, torch.stack(hidden), self.pool)

    # ------------------------------------------------------------------ proposing
    def propose(self, reqs: list[Req], lengths: list[int], items: list[ScheduledItem]) -> list[Proposal | None]:
        proposing = {id(r) for r in reqs}
        segs: list[tuple[Req, int, int]] = []
        seen: set[int] = set()
        for r in [*reqs, *(it.req for it in items)]:
            if id(r) in seen or id(r) not in self._hidden:
                continue
            seen.add(id(r))
            seg = self._segment(r)
            if seg is not None:
                segs.append((r, *seg))
        if not segs:
            return [None] * len(reqs)
        # Only a request whose run reaches its last real token (L - 2) can draft now.
        ready = {id(r) for r, _s, e in segs if id(r) in proposing and e == r.seq_len - 1}
        first = self._run_chunks(segs, ready)
        t1 = time.perf_counter()
        hid_of = {i: first[id(r)][1] for i, r in enumerate(reqs) if id(r) in first}

        def step(active: list[int]) -> dict[int, torch.Tensor]:
            logits, own = self._chain([reqs[i] for i in active], [reqs[i].output_ids[-1] for i in active],
                                      [hid_of[i] for i in active])
            hid_of.update({i: own[j] for j, i in enumerate(active)})
            return {i: logits[j] for j, i in enumerate(active)}

        rows = {i: first[id(r)][0] for i, r in enumerate(reqs) if id(r) in first}
        out, passes = chain_drafts(self.sampler, reqs, lengths, rows, step)
        if reqs and passes:
            self.last_pass_seconds = (time.perf_counter() - t1) / passes / len(reqs)
        return out
